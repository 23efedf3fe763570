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

Length bias. Dropping stale groups drops the long ones first (they take longest, so they are the
oldest when they finish), and training then sees mostly short episodes. ``stale_groups`` chooses
what to do about it: ``prevent`` (the default) trains groups in the order they started and starts
a group only when it will be trained within the bound, so nothing goes stale; ``requeue`` restarts
a dropped group's task first, under new weights; ``drop`` loses it. ``length/*`` metrics
(:mod:`.length_mix`) measure the mix in every run.

Off-policy correction needs nothing new: every sampled token carries the log-prob it was sampled
with, and the loss's clipped importance ratio is per token, so groups one or two versions old,
and PIPELINE's episodes whose tokens come from several versions, are weighted correctly.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cookbook_lib.codecs import Codec
from cookbook_lib.envs.base import Task
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.length_mix import TurnCounter, add_dropped_groups, group_turns
from cookbook_lib.grpo.lockstep import (
    has_signal,
    sampling_params,
    stepped,
    tasks_for_step,
    train_on_groups,
)
from cookbook_lib.grpo.step import RunContext, StepOutcome, StepTimes
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.grpo.weight_sync import GeneratorReplicas
from cookbook_lib.rollout.episode import Episode
from cookbook_lib.rollout.play import EnvFactory, run_group
from cookbook_lib.runtime.progress import LiveProgress, tokens_status
from cookbook_lib.runtime.timeline import (
    SAMPLING,
    TRAINER_LANE,
    WAITING,
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


@dataclass
class _Flight:
    """A group being played: which one, under which version it started, how far it got."""

    index: int
    start_version: int
    turns: TurnCounter


def task_for_group(tasks: Sequence[Task], config: GRPOConfig, index: int) -> Task:
    """The task of the run's ``index``-th group: the one lockstep plays in the same place (slot
    ``index % batch_size`` of step ``index // batch_size + 1``'s first round).

    With the same seed, an async run that trains every group it starts trains lockstep's tasks in
    lockstep's order, so the two compare on the same work; and a resumed run draws from where the
    interrupted one stopped.
    """
    step, slot = divmod(index, config.batch_size)
    return tasks_for_step(tasks, config, step + 1, 0, config.batch_size)[slot]


class RolloutCollector:
    """``groups_in_flight`` workers playing groups on the replicas, feeding a queue of finished groups.

    The trainer calls :meth:`take` until it has its batch (telling :meth:`expect` how many more
    it needs), and :meth:`advance` after each optimizer step. A worker starts a group only while
    collection is not paused, fewer than ``groups_in_flight`` finished groups wait in the queue (so
    a fast generator does not pile up groups that will go stale), and some replica holds weights
    young enough; with ``stale_groups="prevent"`` also only if the group will be trained within
    the bound.
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
        self.requeued = 0
        self._dropped_turns: list[int] = []  # turns of the groups dropped since the last pop
        self._retry: list[int] = []  # heap of the group indices to replay first ("requeue")
        # At least how many more groups the trainer's current step will take (see _trainable_in_time).
        self._step_needs = config.batch_size
        self._finished: list[CollectedGroup] = []
        self._error: BaseException | None = None
        self._in_flight: dict[asyncio.Task[list[Episode]], _Flight] = {}
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

    async def expect(self, groups: int) -> None:
        """The trainer's current step will take at least ``groups`` more groups (0: it is training).

        ``prevent`` needs it: a group started now is trained in this step if fewer groups are
        ahead of it, and otherwise in a later one (each takes at least ``batch_size``). More
        expected may let a worker start, so the workers re-check.
        """
        self._step_needs = groups
        await self.replicas.notify()

    async def take(self) -> CollectedGroup:
        """The finished group that started first (waiting for one); raises what a worker's group raised.

        Oldest-started, not first-finished: a long group that finishes behind several short
        ones is taken before them, while it is still young enough. First-finished order trains
        almost only short episodes when lengths are long-tailed (measured: bench/bench_async.py).
        With ``stale_groups="prevent"`` the order is strict: while an older group is still being
        played, take() waits for it.
        """
        self.start()
        await self.replicas.wait_for(lambda: self._takeable() is not None or self._error is not None)
        if self._error is not None:
            raise self._error
        position = self._takeable()
        assert position is not None
        group = self._finished.pop(position)
        await self.replicas.notify()  # room in the queue: a worker may start
        return group

    def drop_stale(self, group: CollectedGroup) -> None:
        """Count a group the trainer took and found too old (and replay its task, with ``requeue``)."""
        self._drop(group.index, group_turns(group.episodes))

    def pop_dropped_turns(self) -> list[int]:
        """The turns of each group dropped as stale since the last call (for the ``length/*`` metrics)."""
        dropped, self._dropped_turns = self._dropped_turns, []
        return dropped

    async def advance(self, trainer_version: int) -> None:
        """The trainer stepped: cancel the groups in flight that can no longer be trained."""
        self.trainer_version = trainer_version
        self._step_needs = self.config.batch_size  # the next step's
        for task, flight in self._in_flight.items():
            if self.is_stale(flight.start_version) and not task.done():
                task.cancel()
                self.cancelled_stale += 1
                self._drop(flight.index, flight.turns.turns)
        await self.replicas.notify()

    def _drop(self, index: int, turns: int) -> None:
        self.dropped_stale += 1
        self._dropped_turns.append(turns)
        if self.config.stale_groups == "requeue":
            heapq.heappush(self._retry, index)  # the same task, replayed before any new one
            self.requeued += 1

    def _takeable(self) -> int | None:
        """Where in the queue the group take() returns now is; None: nothing to take yet."""
        if not self._finished:
            return None
        oldest = min(range(len(self._finished)), key=lambda i: self._finished[i].index)
        if self.config.stale_groups == "prevent" and any(
            flight.index < self._finished[oldest].index for flight in self._in_flight.values()
        ):
            return None  # strict order: an older group is still being played
        return oldest

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
    def _startable_replicas(self) -> list[int]:
        versions = [self.replicas.replica_version(i) for i in range(self.replicas.size)]
        return [i for i, version in enumerate(versions) if self._trainable_in_time(version)]

    def _trainable_in_time(self, version: int) -> bool:
        """Whether a group started now under ``version`` can still be trained within the bound.

        With ``prevent`` the trainer takes groups in the order they started. The groups ahead of a
        new one are those started and not yet taken; the current step takes at least
        ``_step_needs`` of them and every later step at least ``batch_size``. So the new group is
        trained within the current step if fewer than ``_step_needs`` are ahead, else within
        ``1 + (ahead - _step_needs) // batch_size`` more steps, which must fit in what is left of
        its age allowance. (Without ``prevent`` a group only needs fresh weights to start.)
        """
        if self.is_stale(version):
            return False
        if self.config.stale_groups != "prevent":
            return True
        steps_left = self.max_age - (self.trainer_version - version)
        ahead = len(self._in_flight) + len(self._finished)
        return ahead < self._step_needs + steps_left * self.config.batch_size

    def _may_start(self) -> bool:
        return (
            self._collecting
            and self._error is None
            and len(self._finished) < self.config.effective_groups_in_flight
            and bool(self._startable_replicas())
        )

    async def _work(self) -> None:
        while True:
            await self.replicas.wait_for(self._may_start)
            replica = min(self._startable_replicas(), key=lambda i: self._load[i])
            try:
                await self._play(replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # stops the run: the trainer's next take() raises it
                self._error = exc
                await self.replicas.notify()
            if self._error is not None:
                return

    async def _play(self, replica: int) -> None:
        """Play one group on ``replica`` and queue it for the trainer (unless cancelled as stale).

        A requeued task is replayed before any new one, under its old index: it is still the
        oldest-started group's task, so the trainer takes it first.
        """
        if self._retry:
            index = heapq.heappop(self._retry)
        else:
            index = self.next_group_index
            self.next_group_index += 1
        start_version = self.replicas.replica_version(replica)
        started = time.perf_counter()
        turns = TurnCounter(self.config.max_turns)
        group_task = asyncio.create_task(
            run_group(
                turns.env_factory(self.replicas.env_factory(self.env_factory, replica)),
                task_for_group(self.tasks, self.config, index),
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
        self._in_flight[group_task] = _Flight(index, start_version, turns)
        self._load[replica] += 1
        try:
            await asyncio.wait({group_task})
        finally:
            # Leaving the in-flight set and joining the queue (or setting the error) happen with no
            # await between: take() in strict order must never see the group in neither place.
            del self._in_flight[group_task]
            self._load[replica] -= 1
            if group_task.done() and not group_task.cancelled():
                if group_task.exception() is None:
                    self._finished.append(
                        CollectedGroup(
                            episodes=group_task.result(),
                            index=index,
                            replica=replica,
                            start_version=start_version,
                            started_at=started,
                            finished_at=time.perf_counter(),
                        )
                    )
                else:  # stops the run: the trainer's next take() raises it
                    self._error = group_task.exception()
            elif not group_task.done():  # this worker was cancelled: the group goes with it
                group_task.cancel()
                await asyncio.gather(group_task, return_exceptions=True)
            await self.replicas.notify()


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
        dropped_before, requeued_before = collector.dropped_stale, collector.requeued
        taken: list[CollectedGroup] = []
        with_signal, wait_s = 0, 0.0
        # As in lockstep, at most batch_size * max_sampling_attempts groups for one step.
        most = config.batch_size * config.max_sampling_attempts
        await collector.expect(config.batch_size)
        tokens = tokens_status(self.replicas.generators)

        def status() -> str:
            stale = collector.dropped_stale - dropped_before
            return f"{tokens()} · {len(taken) - with_signal} without signal · {stale} stale"

        # The bar counts the groups this step trains on (those with signal), as they arrive.
        async with LiveProgress(
            f"step {step} groups", config.batch_size, unit="group", status=status
        ) as live:
            while with_signal < config.batch_size and len(taken) < most:
                asked = time.perf_counter()
                group = await collector.take()
                got = time.perf_counter()
                wait_s += got - asked
                timeline.add(TRAINER_LANE, WAITING, asked, got)
                if collector.is_stale(group.start_version):
                    collector.drop_stale(group)
                    continue
                taken.append(group)
                signal = has_signal(group.episodes, config)
                with_signal += signal
                live.done(int(signal))
                await collector.expect(min(config.batch_size - with_signal, most - len(taken)))
        ages = [collector.trainer_version - group.start_version for group in taken]
        times = StepTimes(started=started, sampled_at=time.perf_counter())
        # On a worker thread: the event loop keeps stepping environments and feeding the generators.
        metrics = await asyncio.get_running_loop().run_in_executor(
            self._train_thread, train_on_groups, config, [g.episodes for g in taken], self.trainer
        )
        times.trained_at = time.perf_counter()
        if stepped(metrics):
            version = self.replicas.version + 1
            await self.replicas.publish(self.trainer.export_weights(copy=self.replicas.deferred), version)
            await collector.advance(version)
        times.synced_at = time.perf_counter()
        times.record(timeline, waited=False)  # each wait for a group was recorded as it happened
        metrics |= times.metrics(trainer_idle_s=wait_s)
        metrics |= {
            "policy_version": float(self.replicas.version),
            "async/train_wait_s": wait_s,
            "async/dropped_stale_groups": float(collector.dropped_stale - dropped_before),
            "async/requeued_groups": float(collector.requeued - requeued_before),
            "async/policy_age_mean": sum(ages) / len(ages) if ages else 0.0,
            "async/policy_age_max": float(max(ages, default=0)),
            "async/groups_in_flight": float(collector.num_in_flight),
            "async/groups_waiting": float(collector.num_finished),
            "async/generator_busy_fraction": self._generator_busy_fraction(started, times.synced_at),
        }
        add_dropped_groups(metrics, collector.pop_dropped_turns(), config.max_turns)
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


class AsyncLoop:
    """Async GRPO as a :class:`~cookbook_lib.grpo.step.TrainingLoop`: the collector's workers play
    groups all along; each step takes fresh ones, trains and publishes (:class:`AsyncGRPO`)."""

    def __init__(self, context: RunContext, first_group_index: int = 0) -> None:
        c = context
        self.collector = RolloutCollector(
            c.config, c.tasks, c.env_factory, c.replicas, c.codec, first_group_index=first_group_index
        )
        self.trainer_side = AsyncGRPO(c.config, self.collector, c.trainer, c.replicas, c.timeline)
        self._sequential_validation = c.config.sequential_validation

    async def step(self, step: int) -> StepOutcome:
        return await self.trainer_side.step(step)

    async def close(self) -> None:
        # Cancel what is in flight first (each episode closes its environment), then the trainer.
        await self.collector.stop()
        await self.trainer_side.close()

    @property
    def groups_started(self) -> int:
        return self.collector.next_group_index

    @contextlib.asynccontextmanager
    async def validation_pause(self) -> AsyncIterator[None]:
        """With ``sequential_validation``, collection pauses (the groups in flight finish) so that
        validation runs on its own, and resumes after."""
        if not self._sequential_validation:
            yield
            return
        await self.collector.pause()
        try:
            yield
        finally:
            await self.collector.resume()
