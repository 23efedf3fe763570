"""recipes/grpo/minimal_lockstep.py, the GRPO loop on one page, trains what ``train_multi_turn`` trains.

Both start from the same tiny model, warm-started on two expert episodes of one task that disagree
on the final answer (so its groups hold right and wrong answers: they train), with the same seed
and settings. Then, step by step: the same episodes are sampled (the same tokens; a group's
episodes compared as a set, since which episode draws which seed depends on when replies finish),
the same rewards, and the same loss.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest

from cookbook_lib.codecs import make_codec
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.sft import collect_demonstrations, train_sft
from cookbook_lib.grpo.train import train_multi_turn
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.runtime.models import tiny_random_model
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks, make_tool_use_game_expert
from recipes.grpo import minimal_lockstep as minimal

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny model that knows the tool call for one task and half-knows its answer, and that task."""
    task = next(t for t in load_tool_use_game_tasks("train") if t.metadata["tier"] == 1)
    model, tokenizer = tiny_random_model(seed=0, embedding_scale=10.0)
    codec = make_codec(tokenizer)
    [right] = asyncio.run(
        collect_demonstrations([task], lambda _: ToolUseGameEnv(), make_tool_use_game_expert, max_turns=4)
    )
    wrong = copy.deepcopy(right)
    wrong.messages[-1]["content"] = str(int(wrong.messages[-1]["content"]) + 1)
    trainer = PolicyTrainer(model, pad_token_id=tokenizer.pad_token_id, learning_rate=2e-2)
    train_sft(trainer, codec, [right, wrong], steps=60, batch_size=2, seed=0)
    folder = tmp_path_factory.mktemp("warm")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), task


def test_the_minimal_loop_trains_what_train_multi_turn_trains(start, tmp_path):
    folder, task = start
    settings = minimal.Settings(
        model=folder,
        num_steps=2,
        batch_size=1,
        episodes_per_task=4,
        max_turns=3,
        max_model_length=2048,
        max_tokens_per_turn=40,
        learning_rate=1e-3,
    )
    ours = asyncio.run(minimal.run(settings, tasks=[task]))
    config = GRPOConfig(
        model=folder,
        num_steps=settings.num_steps,
        batch_size=settings.batch_size,
        episodes_per_task=settings.episodes_per_task,
        max_turns=settings.max_turns,
        max_model_length=settings.max_model_length,
        max_tokens_per_turn=settings.max_tokens_per_turn,
        learning_rate=settings.learning_rate,
        micro_batch_tokens=4096,
        overlong_penalty_factor=0.0,  # the minimal loop shapes no rewards
        validation_interval=0,
        checkpoint_interval=0,
        final_checkpoint="model",
        runs_dir=str(tmp_path),
        run_name="library",
        wandb_project=None,
    )
    library = train_multi_turn(config, tasks=[task], env_factory=lambda _: ToolUseGameEnv())
    trained = 0
    for record, metrics in zip(ours, [m for m in library.metrics if m["step"] > 0], strict=True):
        lines = (library.run_dir / "episodes" / f"step_{record.step:06d}.jsonl").read_text().splitlines()
        theirs = [json.loads(line) for line in lines]
        # The same episodes: every sampled token, in the same turns.
        assert sorted(_sampled(e) for e in theirs) == sorted(_our_sampled(r) for r in record.rollouts)
        assert sorted(e["reward"] for e in theirs) == sorted(r.reward for r in record.rollouts)
        if metrics["trained_groups"]:
            trained += 1
            # The same loss and the same gradient (its norm), so the same weights for the next step.
            assert record.loss == pytest.approx(metrics["train/policy_loss"], rel=1e-4, abs=1e-6)
            assert record.grad_norm == pytest.approx(metrics["train/grad_norm"], rel=1e-4)
            assert record.grad_norm > 1e-3
        else:
            assert math.isnan(record.loss)
    assert trained >= 1, "no step trained: the comparison would say nothing about training"


def _sampled(episode: dict) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(turn["sampled_tokens"]) for turn in episode["turns"])


def _our_sampled(rollout: minimal.Rollout) -> tuple[tuple[int, ...], ...]:
    turns, current = [], []
    for sequence in rollout.sequences:
        for token, sampled in zip(sequence.tokens, sequence.sampled, strict=True):
            if sampled:
                current.append(token)
            elif current:
                turns.append(tuple(current))
                current = []
        if current:
            turns.append(tuple(current))
            current = []
    return tuple(turns)
