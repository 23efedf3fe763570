"""The lockstep GRPO step: sample groups, build samples, train, publish the new weights.

Rollouts finish before training starts, so the generator idles while the trainer works and the
other way round; the async loop (a later module) overlaps them. Both share everything here but
the scheduling.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cookbook_lib.codecs import Codec
from cookbook_lib.envs.base import Task
from cookbook_lib.episode import Episode
from cookbook_lib.generators import Generator, SamplingParams
from cookbook_lib.grpo.advantages import is_usable, is_zero_variance, shaped_rewards
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.samples import build_samples
from cookbook_lib.grpo.trainer import LossSettings, PolicyTrainer
from cookbook_lib.metrics import episode_stats
from cookbook_lib.model_policy import ModelPolicy
from cookbook_lib.rollout import EnvFactory, run_group


@dataclass
class StepOutcome:
    """One optimizer step: its metrics (the step log line) and the episodes it sampled."""

    step: int
    metrics: dict[str, float]
    episodes: list[Episode] = field(repr=False)


def sampling_params(config: GRPOConfig, codec: Codec) -> SamplingParams:
    return SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens_per_turn,
        stop_token_ids=list(codec.stop_token_ids),
    )


def loss_settings(config: GRPOConfig) -> LossSettings:
    return LossSettings(
        loss_type=config.loss_type,
        importance_ratio_level=config.importance_ratio_level,
        aggregation=config.loss_aggregation,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        kl_coef=config.kl_coef,
        horizon=config.max_model_length,
    )


def tasks_for_step(
    tasks: Sequence[Task], config: GRPOConfig, step: int, attempt: int, count: int
) -> list[Task]:
    """The tasks a step samples: a function of (seed, step, attempt) alone, so a resumed run
    draws exactly what the uninterrupted run would have drawn."""
    rng = random.Random(f"{config.seed}/{step}/{attempt}")
    if count <= len(tasks):
        return rng.sample(list(tasks), count)
    return [rng.choice(list(tasks)) for _ in range(count)]


def _has_signal(group: Sequence[Episode], config: GRPOConfig) -> bool:
    usable = [episode for episode in group if is_usable(episode)]
    shaped = shaped_rewards(
        usable,
        max_model_length=config.max_model_length,
        overlong_buffer_tokens=config.overlong_buffer_tokens,
        overlong_penalty_factor=config.overlong_penalty_factor,
    )
    return len(shaped) >= 2 and not is_zero_variance(shaped)


async def collect_groups(
    config: GRPOConfig,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    policy_factory: Callable[[], ModelPolicy],
    step: int,
) -> tuple[list[list[Episode]], int]:
    """Groups for one step: ``batch_size`` tasks, then up to ``max_sampling_attempts - 1`` more
    rounds for the groups that came back without signal (all rewards equal).

    Returns every group sampled (zero-variance ones included, so the skip ratio counts them)
    and the number of rounds used.
    """
    groups: list[list[Episode]] = []
    wanted = config.batch_size
    attempt = 0
    while wanted > 0 and attempt < config.max_sampling_attempts:
        round_tasks = tasks_for_step(tasks, config, step, attempt, wanted)
        round_groups = await asyncio.gather(
            *(
                run_group(
                    env_factory,
                    task,
                    policy_factory,
                    config.episodes_per_task,
                    max_turns=config.max_turns,
                    on_env_error=config.on_env_error,
                    failed_parse_reward=config.failed_parse_reward,
                )
                for task in round_tasks
            )
        )
        groups += round_groups
        wanted -= sum(_has_signal(group, config) for group in round_groups)
        attempt += 1
    return groups, attempt


async def lockstep_step(
    config: GRPOConfig,
    step: int,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    trainer: PolicyTrainer,
    generator: Generator,
    codec: Codec,
) -> StepOutcome:
    """Sample, train and publish once; the returned metrics use the seed's names."""
    started = time.perf_counter()
    sampling = sampling_params(config, codec)
    groups, attempts = await collect_groups(
        config,
        tasks,
        env_factory,
        lambda: ModelPolicy(generator, codec, sampling, config.max_model_length),
        step,
    )
    sampled_at = time.perf_counter()
    batch = build_samples(
        groups,
        normalize_by_std=config.normalize_advantages_by_std,
        overlong_masking=config.overlong_masking,
        max_model_length=config.max_model_length,
        overlong_buffer_tokens=config.overlong_buffer_tokens,
        overlong_penalty_factor=config.overlong_penalty_factor,
    )
    episodes = [episode for group in groups for episode in group]
    # Episode stats last: reward_mean over every episode, as validation's val/reward_mean is.
    metrics: dict[str, float] = {**batch.stats.metrics(), **episode_stats(episodes)}
    metrics["sampling_attempts"] = float(attempts)
    if batch.samples:
        # Train only on a full batch's worth of signal: at most batch_size trained groups.
        keep = set(batch.trained_group_indices[: config.batch_size])
        samples = [sample for sample in batch.samples if sample.group_index in keep]
        metrics |= {f"train/{k}": v for k, v in trainer.grpo_step(samples, loss_settings(config)).items()}
        metrics["trained_groups"] = float(len(keep))
    else:
        metrics["trained_groups"] = 0.0
    trained_at = time.perf_counter()
    if metrics["trained_groups"] and not metrics.get("train/skipped_step"):
        await generator.update_weights(trainer.export_weights(), generator.policy_version + 1)
    synced_at = time.perf_counter()
    metrics |= {
        "time/sampling_s": sampled_at - started,
        "time/training_s": trained_at - sampled_at,
        "time/weight_sync_s": synced_at - trained_at,
        "time/step_s": synced_at - started,
        "policy_version": float(generator.policy_version),
    }
    return StepOutcome(step=step, metrics=metrics, episodes=episodes)
