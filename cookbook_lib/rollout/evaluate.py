"""Scoring a model on an environment: play episodes, report reward, pass@k and end causes.

``evaluate`` is what a user runs before training ("can the base model do this at all?") and what
validation runs during training. It writes every episode to ``runs/<run_name>/episodes.jsonl``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cookbook_lib.codecs import Codec, make_codec
from cookbook_lib.envs.base import Task
from cookbook_lib.envs.contract import check_tasks
from cookbook_lib.generators import Generator, SamplingParams
from cookbook_lib.generators.factory import make_generator
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import EnvFactory, OnEnvError, Policy, run_group
from cookbook_lib.rollout.records import write_episodes
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.devices import check_precision
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.runtime.progress import LiveProgress, tokens_status


@dataclass
class EvalReport:
    """What an evaluation found. ``pass_at_k[k]``: the chance that k tries include a success."""

    mean_reward: float
    reward_std: float
    pass_at_k: dict[int, float]
    end_causes: dict[str, int]
    num_episodes: int
    sampled_tokens: int
    wall_time_s: float
    episodes: list[Episode] = field(repr=False)
    episodes_path: Path | None = None

    def summary(self) -> dict[str, float | int]:
        """The headline numbers, flat, for a table row or a log line."""
        row: dict[str, float | int] = {
            "mean_reward": round(self.mean_reward, 4),
            "episodes": self.num_episodes,
            **{f"pass@{k}": round(v, 4) for k, v in self.pass_at_k.items()},
            **{f"{cause.lower()}": self.end_causes.get(cause, 0) for cause in _CAUSE_NAMES},
            "sampled_tokens": self.sampled_tokens,
            "wall_time_s": round(self.wall_time_s, 2),
        }
        return row


_CAUSE_NAMES = [cause.value for cause in EndCause]


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one task (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def summarize(
    groups: Sequence[Sequence[Episode]], wall_time_s: float, success_threshold: float = 1.0
) -> EvalReport:
    """Build a report from groups of episodes (one group per task)."""
    episodes = [episode for group in groups for episode in group]
    if not episodes:
        raise ValueError("no episodes to summarize")
    rewards = [episode.reward for episode in episodes]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    group_size = min(len(group) for group in groups)
    ks = sorted({1, group_size})
    passes = {
        k: sum(
            pass_at_k(len(group), sum(e.reward >= success_threshold for e in group), k) for group in groups
        )
        / len(groups)
        for k in ks
    }
    causes = Counter(episode.end_cause.value for episode in episodes)
    sampled = sum(len(turn.sampled_tokens) for episode in episodes for turn in episode.turns)
    return EvalReport(
        mean_reward=mean,
        reward_std=std,
        pass_at_k=passes,
        end_causes=dict(causes),
        num_episodes=len(episodes),
        sampled_tokens=sampled,
        wall_time_s=wall_time_s,
        episodes=episodes,
    )


def default_run_name(prefix: str) -> str:
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def _check_in_flight(max_episodes_in_flight: int | None) -> None:
    if max_episodes_in_flight is not None and max_episodes_in_flight < 1:
        raise ValueError(
            f"max_episodes_in_flight must be at least 1 (or None for no bound), got {max_episodes_in_flight}"
        )


async def evaluate_policy_async(
    policy_factory: Callable[[], Policy],
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    *,
    episodes_per_task: int = 4,
    max_turns: int = 6,
    on_env_error: OnEnvError = "end_episode",
    failed_parse_reward: float = 0.0,
    success_threshold: float = 1.0,
    run_dir: str | Path | None = None,
    progress: str | None = None,
    progress_status: Callable[[], str] | None = None,
    max_episodes_in_flight: int | None = None,
) -> EvalReport:
    """Evaluate any policy (a scripted one, or a model's): every task's group runs concurrently.

    ``progress`` names a bar counting the episodes as they finish (None: no bar), with
    ``progress_status()`` (e.g. the tokens sampled) beside it. ``max_episodes_in_flight`` bounds
    the episodes playing at once (None: all of them); the others start, in task order, as earlier
    ones end. A model's episodes each hold a KV cache, so the bound is a bound on memory.
    """
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    _check_in_flight(max_episodes_in_flight)
    check_tasks(tasks)  # before any episode: each is recorded with its task
    started = time.perf_counter()
    total = len(tasks) * episodes_per_task
    slots = None if max_episodes_in_flight is None else asyncio.Semaphore(max_episodes_in_flight)
    async with LiveProgress(
        progress or "", total, unit="episode", status=progress_status, show=bool(progress)
    ) as live:
        groups = await asyncio.gather(
            *(
                run_group(
                    env_factory,
                    task,
                    policy_factory,
                    episodes_per_task,
                    max_turns=max_turns,
                    on_env_error=on_env_error,
                    failed_parse_reward=failed_parse_reward,
                    on_episode=lambda _: live.done(),
                    episode_slots=slots,
                )
                for task in tasks
            )
        )
    report = summarize(groups, time.perf_counter() - started, success_threshold)
    if run_dir is not None:
        report.episodes_path = write_episodes(report.episodes, Path(run_dir) / "episodes.jsonl")
    return report


def evaluate_policy(*args, **kwargs) -> EvalReport:
    """Sync form of :func:`evaluate_policy_async` (works inside notebooks too)."""
    return run_sync(evaluate_policy_async(*args, **kwargs))


async def evaluate_async(
    model: str | PreTrainedModel | None,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    generator: Generator | None = None,
    codec: Codec | None = None,
    episodes_per_task: int = 4,
    max_turns: int = 6,
    max_model_length: int = 2048,
    sampling: SamplingParams | None = None,
    failed_parse_reward: float = 0.0,
    on_env_error: OnEnvError = "end_episode",
    success_threshold: float = 1.0,
    run_name: str | None = None,
    runs_dir: str | Path = "runs",
    device: str = "auto",
    dtype: str = "auto",
    enable_thinking: bool | None = None,
    max_episodes_in_flight: int | None = None,
) -> EvalReport:
    """Score a model on an environment: ``episodes_per_task`` episodes of each task.

    ``model`` is a name (``None`` for the embedded default) or a loaded model. A name is loaded on
    ``device`` in the sampling dtype of the ``dtype`` policy (as ``GRPOConfig.device``/``dtype``:
    ``"auto"`` picks CUDA when present, and bf16 where the hardware has it); a loaded model is
    used where and as it is. Pass ``generator`` and ``codec`` to reuse a running generator
    (validation during training does). ``enable_thinking`` switches reasoning in templates that
    have the switch (as ``GRPOConfig.enable_thinking``; ignored when ``codec`` is given).
    ``max_episodes_in_flight`` bounds the episodes (and so the KV caches) alive at once; None plays
    them all together. Episodes are written to ``runs/<run_name>/episodes.jsonl``.
    """
    sampling = sampling or SamplingParams()
    check_tasks(tasks)  # before the model loads
    _check_in_flight(max_episodes_in_flight)
    if sampling.seed is not None and episodes_per_task > 1:
        raise ValueError(
            "sampling.seed would make every episode of a task sample the same replies; leave it None "
            "and call torch.manual_seed(...) first for a reproducible evaluation"
        )
    if max_model_length < 2:
        raise ValueError(f"max_model_length must leave room for a prompt and a reply, got {max_model_length}")
    owned_generator = generator is None
    owned_model = False  # a model evaluate loads itself, only its generator uses
    if generator is None or codec is None:
        if isinstance(model, str) or model is None:
            tokenizer = tokenizer or load_tokenizer(model)
            # The template self-check, on the tokenizer alone: a template no codec serves fails
            # before the model is loaded.
            codec = codec or make_codec(tokenizer, enable_thinking=enable_thinking)
            if generator is None:
                precision = check_precision(device, dtype)  # before loading: a bad device fails fast
                model = load_model(model, device=precision.device, dtype=precision.sample_dtype)
                owned_model = True
            else:
                model = None
        elif tokenizer is None:
            raise ValueError(
                "pass the tokenizer along with a loaded model: evaluate(model, ..., tokenizer=...)"
            )
        codec = codec or make_codec(tokenizer, enable_thinking=enable_thinking)
        if generator is None:
            generator = make_generator("hf", model, tokenizer, owns_model=owned_model)
    run_dir = Path(runs_dir) / (run_name or default_run_name("eval"))
    try:
        return await evaluate_policy_async(
            lambda: ModelPolicy(generator, codec, sampling, max_model_length),
            tasks,
            env_factory,
            episodes_per_task=episodes_per_task,
            max_turns=max_turns,
            on_env_error=on_env_error,
            failed_parse_reward=failed_parse_reward,
            success_threshold=success_threshold,
            run_dir=run_dir,
            progress="evaluation",
            progress_status=tokens_status([generator]),
            max_episodes_in_flight=max_episodes_in_flight,
        )
    finally:
        if owned_generator:
            await generator.close()


def evaluate(*args, **kwargs) -> EvalReport:
    """Sync form of :func:`evaluate_async`; see it for the arguments (works in notebooks too)."""
    return run_sync(evaluate_async(*args, **kwargs))
