"""The lockstep GRPO step: sample groups, build samples, train, publish the new weights.

Rollouts finish before training starts, so the generators idle while the trainer works and the
other way round; the async loop (:mod:`.async_loop`) overlaps them. Both train through
:func:`train_on_groups`; they differ only in how groups are scheduled.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from cookbook_lib.codecs import Codec
from cookbook_lib.envs.base import Task
from cookbook_lib.generators import SamplingParams
from cookbook_lib.grpo.advantages import group_has_signal
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.length_mix import add_dropped_groups, trained_length_metrics
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.samples import LossCounts, SampleBatch, TrainingSample, build_samples, version_mix
from cookbook_lib.grpo.step import RunContext, StepOutcome, StepTimes, no_pause
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.grpo.weight_sync import GeneratorReplicas
from cookbook_lib.rollout.episode import Episode
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import EnvFactory, run_group
from cookbook_lib.runtime.metrics import episode_stats
from cookbook_lib.runtime.progress import LiveProgress, tokens_status
from cookbook_lib.runtime.timeline import Timeline


def sampling_params(config: GRPOConfig, codec: Codec) -> SamplingParams:
    return SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens_per_turn,
        stop_token_ids=list(codec.stop_token_ids),
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


def has_signal(group: Sequence[Episode], config: GRPOConfig) -> bool:
    """Whether ``group`` would train under ``config`` (see ``advantages.group_has_signal``)."""
    return group_has_signal(
        group,
        max_model_length=config.max_model_length,
        overlong_buffer_tokens=config.overlong_buffer_tokens,
        overlong_penalty_factor=config.overlong_penalty_factor,
    )


async def collect_groups(
    config: GRPOConfig,
    tasks: Sequence[Task],
    env_factory: Callable[[int], EnvFactory],
    policy_factory: Callable[[int], Callable[[], ModelPolicy]],
    step: int,
    status: Callable[[], str] | None = None,
    between_rounds: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[list[Episode]], int]:
    """Groups for one step: ``batch_size`` tasks, then up to ``max_sampling_attempts - 1`` more
    rounds for the groups that came back without signal (all rewards equal).

    ``env_factory(i)`` and ``policy_factory(i)`` give the factories of the round's ``i``-th group
    (with several generator replicas, groups are spread over them). Returns every group sampled (zero-variance
    ones included, so the skip ratio counts them) and the number of rounds used. A progress bar
    counts each round's episodes as they finish, with ``status()`` (the tokens sampled) beside it.
    ``between_rounds()`` is awaited after a round that another follows (every episode has ended).
    """
    groups: list[list[Episode]] = []
    wanted = config.batch_size
    attempt = 0
    while wanted > 0 and attempt < config.max_sampling_attempts:
        if attempt and between_rounds is not None:
            await between_rounds()
        round_tasks = tasks_for_step(tasks, config, step, attempt, wanted)
        desc = f"step {step} sampling" + (f" (round {attempt + 1})" if attempt else "")
        episodes = len(round_tasks) * config.episodes_per_task
        async with LiveProgress(desc, episodes, unit="episode", status=status) as live:
            round_groups = await asyncio.gather(
                *(
                    run_group(
                        env_factory(index),
                        task,
                        policy_factory(index),
                        config.episodes_per_task,
                        max_turns=config.max_turns,
                        on_env_error=config.on_env_error,
                        failed_parse_reward=config.failed_parse_reward,
                        on_episode=lambda _: live.done(),
                    )
                    for index, task in enumerate(round_tasks)
                )
            )
        groups += round_groups
        wanted -= sum(has_signal(group, config) for group in round_groups)
        attempt += 1
    return groups, attempt


def step_samples(
    config: GRPOConfig, groups: Sequence[Sequence[Episode]]
) -> tuple[SampleBatch, list[TrainingSample], set[int]]:
    """The samples a step trains on ``groups``, with the whole ``SampleBatch`` and the indices of
    the groups kept: at most ``batch_size`` groups with signal, a full batch's worth."""
    batch = build_samples(
        groups,
        normalize_by_std=config.normalize_advantages_by_std,
        overlong_masking=config.overlong_masking,
        max_model_length=config.max_model_length,
        overlong_buffer_tokens=config.overlong_buffer_tokens,
        overlong_penalty_factor=config.overlong_penalty_factor,
    )
    keep = set(batch.trained_group_indices[: config.batch_size]) if batch.samples else set()
    return batch, [sample for sample in batch.samples if sample.group_index in keep], keep


def loss_counts(
    config: GRPOConfig, batch: SampleBatch, samples: Sequence[TrainingSample], keep: set[int]
) -> LossCounts:
    """The counts the step's loss is normalised by (``GRPOConfig.loss_normalizer``): its samples',
    plus, for ``batch_groups``, the zero-variance groups that stand in for the ``batch_size``
    groups with signal the step lacks (the first ones sampled)."""
    counts = LossCounts.of(samples)
    if config.loss_normalizer == "batch_groups":
        for extra in batch.zero_variance_counts[: max(config.batch_size - len(keep), 0)]:
            counts += extra
    return counts


def train_on_groups(config: GRPOConfig, groups: Sequence[Sequence[Episode]], trainer: PolicyTrainer) -> dict:
    """Build samples from ``groups`` and take one optimizer step on them (if any has signal).

    Returns the step's metrics: sample statistics (``zero_variance_skip_ratio`` ...), episode
    statistics under the seed's names, ``train/*`` from the trainer and ``trained_groups``. Runs
    the gradient step in the caller's thread (the async loop calls it on a worker thread).
    """
    batch, samples, keep = step_samples(config, groups)
    episodes = [episode for group in groups for episode in group]
    # Episode stats last: reward_mean over every episode, as validation's val/reward_mean is.
    metrics: dict[str, float] = {**batch.stats.metrics(), **episode_stats(episodes)}
    if samples:
        counts = loss_counts(config, batch, samples, keep)
        settings = LossSettings.from_config(config)
        metrics |= {f"train/{k}": v for k, v in trainer.grpo_step(samples, settings, counts).items()}
    metrics["trained_groups"] = float(len(keep))
    metrics |= {f"train/{k}": v for k, v in version_mix(samples).items()}
    # The length mix of what trained (lockstep's is the reference an async run is compared with).
    metrics |= trained_length_metrics(groups, samples, keep, config.max_turns)
    return metrics


def stepped(metrics: dict[str, float]) -> bool:
    """Whether the optimizer changed the weights (something trained, and the step was not skipped)."""
    return bool(metrics["trained_groups"]) and not metrics.get("train/skipped_step")


async def lockstep_step(
    config: GRPOConfig,
    step: int,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    trainer: PolicyTrainer,
    replicas: GeneratorReplicas,
    codec: Codec,
    timeline: Timeline | None = None,
) -> StepOutcome:
    """Sample, train and publish once; the returned metrics use the seed's names."""
    started = time.perf_counter()
    sampling = sampling_params(config, codec)
    groups, attempts = await collect_groups(
        config,
        tasks,
        lambda index: replicas.env_factory(env_factory, index % replicas.size),
        lambda index: replicas.policy_factory(
            index % replicas.size, codec, sampling, config.max_model_length
        ),
        step,
        status=tokens_status(replicas.generators),
        # The last round's episodes have all ended: their kept caches would sit beside the next's.
        between_rounds=replicas.drop_kept_prefixes,
    )
    times = StepTimes(started=started, sampled_at=time.perf_counter())
    # Every episode has ended: the caches of their last turns would sit beside the step's
    # activations (~0.4 GB at the demo's shape) until the weight update dropped them.
    await replicas.drop_kept_prefixes()
    # A colocated vLLM engine frees its GPU memory for the optimizer step; publish wakes it.
    await replicas.sleep()
    metrics = await replicas.run_compute(lambda: train_on_groups(config, groups, trainer))
    metrics["sampling_attempts"] = float(attempts)
    add_dropped_groups(metrics, [], config.max_turns)  # lockstep drops nothing: zeros, for comparison
    times.trained_at = time.perf_counter()
    if stepped(metrics):
        await replicas.publish(trainer.export_weights(), replicas.version + 1)
    times.synced_at = time.perf_counter()
    times.record(timeline, waited=True)
    # The trainer waits for the whole sampling phase: the idle time async training recovers.
    metrics |= times.metrics(trainer_idle_s=times.sampled_at - times.started)
    metrics["policy_version"] = float(replicas.version)
    return StepOutcome(step=step, metrics=metrics, episodes=[e for group in groups for e in group])


class LockstepLoop:
    """Lockstep GRPO as a :class:`~cookbook_lib.grpo.step.TrainingLoop`: each step samples its
    groups, trains on them and publishes, and nothing runs between steps."""

    def __init__(self, context: RunContext) -> None:
        self.context = context

    async def step(self, step: int) -> StepOutcome:
        c = self.context
        return await lockstep_step(
            c.config, step, c.tasks, c.env_factory, c.trainer, c.replicas, c.codec, c.timeline
        )

    async def close(self) -> None:
        pass  # nothing runs between steps

    @property
    def groups_started(self) -> int:
        return 0  # a step's tasks are a function of (seed, step): nothing to resume

    def validation_pause(self) -> contextlib.AbstractAsyncContextManager[None]:
        return no_pause()
