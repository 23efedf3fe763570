"""Two lockstep GRPO steps on the tool-use game per model family: a tiny random model that uses
that family's tokenizer and shipped chat template, so the template self-check, the SFT warm-start
on expert demonstrations (rendered by the family's codec), sampling, parsing, continuation and
training all run together through ``train_multi_turn``. About 45 s a family on 2 cores.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from cookbook_lib.codecs.reference import reference_tokenizer
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.sft import WarmStart, collect_demonstrations
from cookbook_lib.grpo.train import train_multi_turn
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.models import load_tokenizer, tiny_random_model
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks, make_tool_use_game_expert

pytestmark = pytest.mark.slow

# One template per reply format, the seed page's own Qwen3.x, and Mistral through mistral-common.
FAMILIES = ["qwen3", "qwen3_6", "qwen3_8", "llama3_1", "gptoss", "gemma4", "glm4moe", "lfm2_5", "mistral"]
# What each family's prompts must show: its own turn markup, not ChatML by default.
MARKUP = {
    "qwen3": "<|im_start|>assistant",
    "qwen3_6": "<function=example_function_name>",
    "qwen3_8": "Reasoning effort is set to xhigh",
    "llama3_1": "<|start_header_id|>assistant<|end_header_id|>",
    "gptoss": "<|start|>assistant",
    "gemma4": "<|turn>model",
    "glm4moe": "<|assistant|>",
    "lfm2_5": "List of tools: [",
    "mistral": "[AVAILABLE_TOOLS]",
}


def mistral_model(tokenizer_folder):
    """Mistral Nemo's tekken tokenizer as mistral-common ships it, and a tiny random Mistral model:
    transformers loads a mistral-common tokenizer (MistralCommonBackend) for a Mistral config."""
    mistral_common = pytest.importorskip("mistral_common", reason="pip install -e '.[mistral]'")
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig
    from transformers.tokenization_mistral_common import MistralCommonBackend

    tokenizer_folder.mkdir()
    shutil.copy(
        Path(mistral_common.__file__).parent / "data" / "tekken_240718.json", tokenizer_folder / "tekken.json"
    )
    tokenizer = MistralCommonBackend.from_pretrained(str(tokenizer_folder))
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, sliding_window=None,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(10.0)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def base_tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def demonstrations():
    """The expert's episode on one tier-1 task, and a copy whose answer is off by one.

    A model warm-started on both is sure of the format and of the tool call, and unsure only of
    the final number: its GRPO groups hold right and wrong answers, so they train.
    """
    task = next(t for t in load_tool_use_game_tasks("train") if t.metadata["tier"] == 1)
    expert = make_tool_use_game_expert
    [right] = run_sync(collect_demonstrations([task], lambda _: ToolUseGameEnv(), expert, max_turns=4))
    wrong = copy.deepcopy(right)
    wrong.messages[-1]["content"] = str(int(wrong.messages[-1]["content"]) + 1)
    return task, [right, wrong]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_grpo_steps_through_the_familys_template(family, base_tokenizer, demonstrations, tmp_path):
    task, demos = demonstrations
    if family == "mistral":
        model, tokenizer = mistral_model(tmp_path / "tokenizer")
    else:
        family_tokenizer = reference_tokenizer(family, base_tokenizer)
        model, tokenizer = tiny_random_model(seed=0, embedding_scale=10.0, tokenizer=family_tokenizer)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = GRPOConfig(
        model=str(folder),
        batch_size=1,
        episodes_per_task=4,
        num_steps=2,
        max_turns=3,
        max_sampling_attempts=4,
        max_model_length=2048,
        max_tokens_per_turn=40,
        micro_batch_tokens=4096,
        activation_checkpointing=False,  # a tiny model's activations are small; recomputing them is not
        learning_rate=1e-3,
        validation_interval=0,
        checkpoint_interval=0,
        final_checkpoint="model",
        keep_warm_start_model=False,
        runs_dir=str(tmp_path / "runs"),
        run_name=family,
        wandb_project=None,
    )
    # At 2e-2 over 90 steps the qwen3 model ended its warm-start on a loss spike on an AMD EPYC (its
    # float32 rounding is not the Xeon's) and sampled no well-formed call: a gentler rate, more steps.
    warm_start = WarmStart(demos, steps=120, batch_size=2, learning_rate=1e-2)
    result = train_multi_turn(
        config, tasks=[task], env_factory=lambda _: ToolUseGameEnv(), warm_start=warm_start
    )
    steps = [m for m in result.metrics if m["step"] > 0]
    assert len(steps) == 2
    episodes = [
        json.loads(line)
        for path in sorted((result.run_dir / "episodes").iterdir())
        for line in path.read_text().splitlines()
    ]
    assert [e for e in episodes if e["end_cause"] == "ERROR"] == []
    # The family's own markup reached the model.
    shown = result.tokenizer.decode(episodes[0]["turns"][0]["prompt_tokens"], skip_special_tokens=False)
    assert MARKUP[family] in shown
    # Sampled tool calls parsed and continued: a call, the tool's result, then a right answer.
    solved = [
        e for e in episodes if e["end_cause"] == "TERMINATED" and e["num_turns"] >= 2 and e["reward"] == 1.0
    ]
    assert solved, [(e["end_cause"], e["messages"][2:]) for e in episodes]
    call = solved[0]["messages"][2]
    assert call["tool_calls"][0]["function"]["name"] == "lookup" and call["content"] == ""
    # And trained: right and wrong answers in one group give non-zero advantages.
    assert sum(m["trained_groups"] for m in steps) >= 1
