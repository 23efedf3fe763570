"""Supervised warm-start on demonstrations (assistant tokens only).

The embedded model cannot call tools at first (0 of 32 tries, measured), so GRPO would see no
reward at all. A few SFT steps on a scripted expert's episodes teach it the tool-call format; GRPO
then improves what the format alone does not give. Demonstrations are rendered by the same codec,
token-exactly, as rollouts are (:mod:`cookbook_lib.grpo.demonstrations`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cookbook_lib.codecs import Codec
from cookbook_lib.envs.base import Env, Task
from cookbook_lib.grpo.demonstrations import conversation_sequences
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout.episode import EndCause, TokenSequence
from cookbook_lib.rollout.play import Policy, run_episode
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.types import Message, ToolSpec


@dataclass
class Demonstration:
    """One conversation to imitate, with the tools its system prompt offered."""

    messages: list[Message]
    tool_specs: list[ToolSpec]


@dataclass
class WarmStart:
    """A supervised warm-start on demonstrations before GRPO (skipped when a run resumes)."""

    demonstrations: list[Demonstration]
    steps: int = 8
    batch_size: int = 8
    learning_rate: float = 5e-5


async def collect_demonstrations(
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    expert_factory: Callable[[Task], Policy],
    *,
    max_turns: int,
    min_reward: float = 1.0,
) -> list[Demonstration]:
    """Play the expert on ``tasks``; keep the episodes it solved (reward >= ``min_reward``)."""
    demonstrations = []
    for task in tasks:
        env = env_factory(task)
        episode = await run_episode(env, task, expert_factory(task), max_turns=max_turns)
        if episode.end_cause is EndCause.TERMINATED and episode.reward >= min_reward:
            demonstrations.append(Demonstration(episode.messages, env.tool_specs))
    return demonstrations


def train_sft(
    trainer: PolicyTrainer,
    codec: Codec,
    demonstrations: Sequence[Demonstration],
    *,
    steps: int,
    batch_size: int = 8,
    seed: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps on batches drawn (without replacement, epoch by epoch) from the demos."""
    if not demonstrations:
        raise ValueError("train_sft needs at least one demonstration")
    if steps < 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    sequences: list[TokenSequence] = [
        sequence
        for demo in demonstrations
        for sequence in conversation_sequences(codec, demo.messages, demo.tool_specs)
    ]
    rng = random.Random(seed)
    order: list[int] = []
    history = []
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(sequences)))
            rng.shuffle(fresh)
            order += fresh
        batch, order = order[:batch_size], order[batch_size:]
        metrics = trainer.sft_step([sequences[i] for i in batch])
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return history


def expert_warm_start(
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    expert_factory: Callable[[Task], Policy],
    *,
    num_demonstrations: int,
    steps: int,
    batch_size: int = 8,
    learning_rate: float = 5e-5,
    max_turns: int = 8,
    seed: int = 0,
) -> WarmStart:
    """A :class:`WarmStart` from a scripted expert on a sample of ``tasks``.

    The sample is drawn across all the tasks given (so every tier and phrasing can appear): a
    warm-start on one phrasing overfits to it, measured on the embedded model.
    """
    chosen = random.Random(seed).sample(list(tasks), min(num_demonstrations, len(tasks)))
    demonstrations = run_sync(
        collect_demonstrations(chosen, env_factory, expert_factory, max_turns=max_turns)
    )
    return WarmStart(demonstrations, steps=steps, batch_size=batch_size, learning_rate=learning_rate)
