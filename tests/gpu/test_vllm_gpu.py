"""The real vLLM engine behind ``VLLMGenerator``, on the embedded model: samples, weight updates
(between requests and under a running request), sleep, and a short GRPO run.

Skipped without CUDA or without vllm (``pip install -e ".[vllm]"``). Not yet run anywhere: the
machines this project is built on have no GPU, and vLLM 0.33 needs torch 2.14 (docs/benchmarks.md).
The CPU tests run the same adapter against a fake engine (tests/test_vllm_generator.py).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import Task
from cookbook_lib.generators import SamplingParams
from cookbook_lib.generators.vllm import VLLMGenerator
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import train_single_turn
from cookbook_lib.runtime.models import load_model, load_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("vllm", reason='needs vllm: pip install -e ".[vllm]"')

TIMEOUT_S = 300


def run(coroutine):
    async def guarded():
        return await asyncio.wait_for(coroutine, TIMEOUT_S)

    return asyncio.run(guarded())


def uniform_weights(model) -> dict[str, torch.Tensor]:
    """The model's weights with the final norm zeroed: every logit is 0, every log-prob -log(vocab)."""
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    weights["model.norm.weight"].zero_()
    return weights


# First, before the module's engine exists: a run builds its own engine and closes it.
def test_a_short_grpo_run_samples_with_vllm(tmp_path):
    config = GRPOConfig(
        generator_backend="vllm",
        batch_size=2,
        episodes_per_task=4,
        num_steps=2,
        validation_interval=1,
        max_turns=1,
        max_model_length=512,
        max_tokens_per_turn=16,
        micro_batch_tokens=1024,
        runs_dir=str(tmp_path),
        run_name="vllm",
    )
    tasks = [Task(prompt=f"Name an animal that starts with {c}.", target=None) for c in "ABCD"]
    result = train_single_turn(
        config, tasks=tasks, reward_fn=lambda task, reply: float("a" in reply.lower()), val_tasks=tasks[:2]
    )
    assert [m["step"] for m in result.metrics] == [0, 1, 2]
    assert all(m["reward_mean"] is not None for m in result.metrics[1:])


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer()
    model = load_model(dtype=torch.bfloat16, device="cuda").eval()
    generator = VLLMGenerator.from_model(model, tokenizer, max_model_length=2048)
    yield generator, model, tokenizer
    run(generator.close())


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    _, _, tokenizer = engine
    codec = make_codec(tokenizer)
    return codec.render_prompt([{"role": "user", "content": "What is two plus two?"}], [])


def test_samples_follow_the_models_distribution(engine, prompt):
    generator, model, tokenizer = engine
    stops = list(make_codec(tokenizer).stop_token_ids)
    params = SamplingParams(temperature=1.0, max_tokens=32, stop_token_ids=stops)

    async def go():
        return await asyncio.gather(*(generator.sample(prompt, params) for _ in range(8)))

    for result in run(go()):
        assert len(result.tokens) == len(result.logprobs) == len(result.policy_versions) > 0
        assert result.policy_versions == [0] * len(result.tokens)
        if result.finish_reason == "stop":
            assert result.tokens[-1] in stops
        with torch.no_grad():
            logits = model(torch.tensor([prompt + result.tokens], device="cuda")).logits[
                0, len(prompt) - 1 : -1
            ]
        expected = torch.log_softmax(logits.float(), -1).gather(
            1, torch.tensor(result.tokens, device="cuda")[:, None]
        )
        difference = (torch.tensor(result.logprobs, device="cuda") - expected[:, 0]).abs().mean()
        assert difference < 0.15, difference  # bf16 on both sides, different kernels


def test_a_weight_update_reaches_the_engine(engine, prompt):
    generator, model, _ = engine
    uniform = -math.log(model.config.vocab_size)
    params = SamplingParams(max_tokens=16)

    async def go():
        await generator.update_weights(uniform_weights(model), 1, between_requests=True)
        flat = await generator.sample(prompt, params)
        await generator.update_weights(model.state_dict(), 2, between_requests=True)
        return flat, await generator.sample(prompt, params)

    flat, restored = run(go())
    assert flat.policy_versions == [1] * 16 and flat.logprobs == pytest.approx([uniform] * 16, abs=1e-2)
    assert restored.policy_versions[0] == 2 and restored.logprobs != pytest.approx([uniform] * 16, abs=1e-2)


def test_a_pipeline_update_switches_under_a_running_sample(engine, prompt):
    generator, model, _ = engine
    uniform = -math.log(model.config.vocab_size)

    async def go():
        running = asyncio.create_task(generator.sample(prompt, SamplingParams(max_tokens=1500)))
        await asyncio.sleep(0.3)
        await generator.update_weights(uniform_weights(model), 3)
        result = await running
        await generator.update_weights(model.state_dict(), 4, between_requests=True)
        return result

    result = run(go())
    switch = result.policy_versions.index(3)
    assert switch > 0 and result.policy_versions == [0] * switch + [3] * (len(result.tokens) - switch)
    assert result.logprobs[switch:] == pytest.approx([uniform] * (len(result.tokens) - switch), abs=1e-2)


def test_sleep_frees_gpu_memory_and_a_sample_wakes_the_engine(engine, prompt):
    generator, _, _ = engine

    async def go():
        free_before = torch.cuda.mem_get_info()[0]
        await generator.sleep()
        free_asleep = torch.cuda.mem_get_info()[0]
        result = await generator.sample(prompt, SamplingParams(max_tokens=8))
        return free_asleep - free_before, result, generator.is_sleeping

    freed, result, still_asleep = run(go())
    assert freed > 2**28  # at least the KV cache (gpu_memory_utilization=0.3 of the card)
    assert len(result.tokens) == 8 and not still_asleep
