"""Async GRPO: rollouts run continuously while the trainer steps, within a bound on policy age.

Lockstep leaves each side idle while the other works: the generators wait for the optimizer step,
and the trainer waits for the slowest episode of the batch (a long episode, or a tool that takes
a while to answer). Here ``groups_in_flight`` rollout workers keep playing groups and hand each
finished group to the trainer through a queue; the trainer takes groups as they come and steps as
soon as it holds ``batch_size`` groups with signal.

Policy age. A group records the policy version its replica held when its rollout started. When
the trainer takes it, its age is the number of optimizer steps since then; a group older than
``max_steps_off_policy`` is dropped as stale (and counted). A group in flight that is already too
old is cancelled at once rather than played to the end for nothing (its environments are closed
on the way out), and a worker does not start a group under weights that are already too old
(a deferred publication has not reached its replica yet): it waits for them.

Off-policy correction needs nothing new: every sampled token carries the log-prob it was sampled
with, and the loss's clipped importance ratio is per token, so groups one or two versions old,
and PIPELINE's episodes whose tokens come from several versions, are weighted correctly.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cookbook_lib.codecs import Codec
from cookbook_lib.envs.base import Task
from cookbook_lib.episode import Episode
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.lockstep import StepOutcome, has_signal, sampling_params, stepped, train_on_groups
from cookbook_lib.grpo.replicas import GeneratorReplicas
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout import EnvFactory, run_group
from cookbook_lib.timeline import (
    SAMPLING,
    TRAINER_LANE,
    TRAINING,
    WAITING,
    WEIGHT_SYNC,
    Timeline,
    replica_lane,
)


@dataclass
class CollectedGroup:
    """A finished group and where it came from."""

    episodes: list[Episode] = field(repr=False)
    index: int  # its place in the run's stream of groups (which task it played)
    replica: int
    start_version: int  # the policy version its replica held when the rollout started
    started_at: float
    finished_at: float


def task_for_group(tasks: Sequence[Task], seed: int, index: int) -> Task:
    """The task of the run's ``index``-th group: a function of (seed, index), so a resumed run
    draws from where the interrupted one stopped."""
    return random.Random(f"{seed}/group/{index}").choice(list(tasks))


class RolloutCollector:
    """``groups_in_flight`` workers playing groups on the replicas, feeding a queue of finished groups.

    The trainer calls :meth:`take`, and :meth:`advance` after each optimizer step. A worker starts
    a group only while collection is not paused, fewer than ``groups_in_flight`` finished groups
    wait in the queue (so a fast generator does not pile up groups that will go stale), and some
    replica holds weights young enough.
    """

    def __init__(
        self,
        config: GRPOConfig,
        tasks: Sequence[Task],
        env_factory: EnvFactory,
        replicas: GeneratorReplicas,
        codec: Codec,
        *,
        first_group_index: int = 0,
    ) -> None:
        assert config.max_steps_off_policy is not None, "the collector is for async runs"
        self.config = config
        self.max_age = config.max_steps_off_policy
        self.tasks = list(tasks)
        self.env_factory = env_factory
        self.replicas = replicas
        self.sampling = sampling_params(config, codec)
        self.codec = codec
        self.trainer_version = replicas.version
        self.next_group_index = first_group_index
        self.dropped_stale = 0  # running totals
        self.cancelled_stale = 0
        self._finished: list[CollectedGroup] = []
        self._error: BaseException | None = None
        self._in_flight: dict[asyncio.Task[list[Episode]], int] = {}  # group task -> start version
        self._load = [0] * replicas.size  # groups in flight per replica
        self._collecting = True
        self._workers: list[asyncio.Task[None]] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_finished(self) -> int:
        """Finished groups waiting for the trainer."""
        return len(self._finished)

    def is_stale(self, start_version: int) -> bool:
        return self.trainer_version - start_version > self.max_age

    def start(self) -> None:
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(), name=f"rollout-worker-{i}")
                for i in range(self.config.effective_groups_in_flight)
            ]

    async def take(self) -> CollectedGroup:
        """The finished group that started first (waiting for one); raises what a worker's group raised.

        Oldest-started, not first-finished: a long group that finishes behind several short
        ones is taken before them, while it is still young enough. First-finished order trains
        almost only short episodes when lengths are long-tailed (measured: bench/bench_async.py).
        """
        self.start()
        await self.replicas.wait_for(lambda: bool(self._finished) or self._error is not None)
        if self._error is not None:
            raise self._error
        oldest = min(range(len(self._finished)), key=lambda i: self._finished[i].index)
        group = self._finished.pop(oldest)
        await self.replicas.notify()  # room in the queue: a worker may start
        return group

    def drop_stale(self) -> None:
        """Count a group the trainer took and found too old."""
        self.dropped_stale += 1

    async def advance(self, trainer_version: int) -> None:
        """The trainer stepped: cancel the groups in flight that can no longer be trained."""
        self.trainer_version = trainer_version
        for task, start_version in self._in_flight.items():
            if self.is_stale(start_version) and not task.done():
                task.cancel()
                self.dropped_stale += 1
                self.cancelled_stale += 1
        await self.replicas.notify()

    async def pause(self) -> None:
        """Start no new group and wait until those in flight have finished."""
        self._collecting = False
        await self.replicas.wait_for(lambda: not self._in_flight)

    async def resume(self) -> None:
        self._collecting = True
        await self.replicas.notify()

    async def stop(self) -> None:
        """Cancel the workers and their groups (each episode closes its environment); wait for all."""
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    # --- the workers ----------------------------------------------------------------------------
    def _fresh_replicas(self) -> list[int]:
        return [i for i in range(self.replicas.size) if not self.is_stale(self.replicas.replica_version(i))]

    def _may_start(self) -> bool:
        return (
            self._collecting
            and self._error is None
            and len(self._finished) < self.config.effective_groups_in_flight
            and bool(self._fresh_replicas())
        )

    async def _work(self) -> None:
        while True:
            await self.replicas.wait_for(self._may_start)
            replica = min(self._fresh_replicas(), key=lambda i: self._load[i])
            try:
                group = await self._play(replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # stops the run: the trainer's next take() raises it
                self._error = exc
                await self.replicas.notify()
                return
            if group is not None:
                self._finished.append(group)
                await self.replicas.notify()

    async def _play(self, replica: int) -> CollectedGroup | None:
        """Play one group on ``replica``; None when it was cancelled as stale."""
        index = self.next_group_index
        self.next_group_index += 1
        start_version = self.replicas.replica_version(replica)
        started = time.perf_counter()
        group_task = asyncio.create_task(
            run_group(
                self.replicas.env_factory(self.env_factory, replica),
                task_for_group(self.tasks, self.config.seed, index),
                self.replicas.policy_factory(
                    replica, self.codec, self.sampling, self.config.max_model_length
                ),
                self.config.episodes_per_task,
                max_turns=self.config.max_turns,
                on_env_error=self.config.on_env_error,
                failed_parse_reward=self.config.failed_parse_reward,
            ),
            name=f"group-{index}",
        )
        self._in_flight[group_task] = start_version
        self._load[replica] += 1
        try:
            await asyncio.wait({group_task})
        finally:
            del self._in_flight[group_task]
            self._load[replica] -= 1
            if not group_task.done():  # this worker was cancelled: the group goes with it
                group_task.cancel()
                await asyncio.gather(group_task, return_exceptions=True)
            await self.replicas.notify()
        if group_task.cancelled():
            return None
        return CollectedGroup(
            episodes=group_task.result(),
            index=index,
            replica=replica,
            start_version=start_version,
            started_at=started,
            finished_at=time.perf_counter(),
        )


class AsyncGRPO:
    """The trainer's side of an async run: take fresh groups, step, publish, advance the collector."""

    def __init__(
        self,
        config: GRPOConfig,
        collector: RolloutCollector,
        trainer: PolicyTrainer,
        replicas: GeneratorReplicas,
        timeline: Timeline,
    ) -> None:
        self.config = config
        self.collector = collector
        self.trainer = trainer
        self.replicas = replicas
        self.timeline = timeline
        # One long-lived thread for every optimizer step: glibc gives each thread that allocates
        # its own malloc arena, and the default executor's rotating threads would leave several
        # arenas each holding a step's worth of freed activations (gigabytes of RSS).
        self._train_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cookbook-trainer")

    async def step(self, step: int) -> StepOutcome:
        config, collector, timeline = self.config, self.collector, self.timeline
        started = time.perf_counter()
        dropped_before = collector.dropped_stale
        taken: list[CollectedGroup] = []
        with_signal, wait_s = 0, 0.0
        # As in lockstep, at most batch_size * max_sampling_attempts groups for one step.
        most = config.batch_size * config.max_sampling_attempts
        while with_signal < config.batch_size and len(taken) < most:
            asked = time.perf_counter()
            group = await collector.take()
            got = time.perf_counter()
            wait_s += got - asked
            timeline.add(TRAINER_LANE, WAITING, asked, got)
            if collector.is_stale(group.start_version):
                collector.drop_stale()
                continue
            taken.append(group)
            with_signal += has_signal(group.episodes, config)
        ages = [collector.trainer_version - group.start_version for group in taken]
        sampled_at = time.perf_counter()
        # On a worker thread: the event loop keeps stepping environments and feeding the generators.
        metrics = await asyncio.get_running_loop().run_in_executor(
            self._train_thread, train_on_groups, config, [g.episodes for g in taken], self.trainer
        )
        trained_at = time.perf_counter()
        timeline.add(TRAINER_LANE, TRAINING, sampled_at, trained_at)
        if stepped(metrics):
            version = self.replicas.version + 1
            await self.replicas.publish(self.trainer.export_weights(copy=self.replicas.deferred), version)
            await collector.advance(version)
        synced_at = time.perf_counter()
        timeline.add(TRAINER_LANE, WEIGHT_SYNC, trained_at, synced_at)
        step_s = synced_at - started
        metrics |= {
            "time/sampling_s": sampled_at - started,
            "time/training_s": trained_at - sampled_at,
            "time/weight_sync_s": synced_at - trained_at,
            "time/step_s": step_s,
            "policy_version": float(self.replicas.version),
            "async/train_wait_s": wait_s,
            "time/trainer_idle_fraction": wait_s / step_s if step_s else 0.0,
            "async/dropped_stale_groups": float(collector.dropped_stale - dropped_before),
            "async/policy_age_mean": sum(ages) / len(ages) if ages else 0.0,
            "async/policy_age_max": float(max(ages, default=0)),
            "async/groups_in_flight": float(collector.num_in_flight),
            "async/groups_waiting": float(collector.num_finished),
            "async/generator_busy_fraction": self._generator_busy_fraction(started, synced_at),
        }
        return StepOutcome(step=step, metrics=metrics, episodes=[e for g in taken for e in g.episodes])

    async def close(self) -> None:
        """Wait for a step still training (a cancelled step's thread runs to its end), then stop."""
        await asyncio.to_thread(self._train_thread.shutdown, wait=True)

    def _generator_busy_fraction(self, start: float, end: float) -> float:
        origin = self.timeline.origin
        fractions = [
            self.timeline.busy_fraction(replica_lane(i), SAMPLING, start - origin, end - origin)
            for i in range(self.replicas.size)
        ]
        return sum(fractions) / len(fractions)
