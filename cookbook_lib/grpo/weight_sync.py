"""The generator replicas that serve a run's rollouts, and how new weights reach them.

``num_generator_replicas`` generators (on a CPU, separate model copies sharing the cores; on GPUs,
one per device) each receive every weight update. ``weight_sync_type`` decides how:

- ``WEIGHT_SYNC_TYPE_SYNCHRONOUS``: ``publish`` returns once every replica holds the new weights.
  Each replica switches between requests: samples in flight finish under the old weights first.
- ``WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH``: ``publish`` hands the weights to one background task per
  replica and returns at once; the replica still switches between requests.
- ``WEIGHT_SYNC_TYPE_PIPELINE``: deferred too, and the replica switches between two decode steps,
  so samples in flight go on under the new weights (every token records its version).

A deferred publication that has not started when a newer one arrives is replaced by it: a replica
never loads a version it would overwrite at once. ``version`` is the newest version published;
``replica_version(i)`` what replica ``i`` holds now (it lags in the deferred modes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from cookbook_lib.codecs import Codec
from cookbook_lib.generators import Generator, HFGenerator, SamplingParams
from cookbook_lib.grpo.config import WeightSyncType
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import EnvFactory
from cookbook_lib.runtime.timeline import WEIGHT_SYNC, Timeline, replica_lane, timed_env_factory

Result = TypeVar("Result")

Weights = Mapping[str, torch.Tensor]


class GeneratorReplicas:
    """Several generators behind one publication rule; records weight-sync spans when given a timeline."""

    def __init__(
        self,
        generators: Sequence[Generator],
        weight_sync_type: WeightSyncType = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS,
        timeline: Timeline | None = None,
    ) -> None:
        if not generators:
            raise ValueError("GeneratorReplicas needs at least one generator")
        self.generators = list(generators)
        self.weight_sync_type = WeightSyncType(weight_sync_type)
        self.timeline = timeline
        self.version = max(g.policy_version for g in self.generators)
        self._pending: list[tuple[Weights, int] | None] = [None] * len(self.generators)
        self._wake = [asyncio.Event() for _ in self.generators]
        self._publishers: list[asyncio.Task[None]] = []
        self._changed = asyncio.Condition()
        self._error: BaseException | None = None

    @property
    def size(self) -> int:
        return len(self.generators)

    async def run_compute(self, function: Callable[[], Result]) -> Result:
        """Run a blocking torch computation (a training step) where it costs least: on the one
        generator's worker thread when that is a CPU ``HFGenerator`` (then one OpenMP team does
        all the run's work: ``WorkerGenerator.run_on_worker`` says why), else in this thread."""
        generator = self.generators[0]
        if self.size == 1 and isinstance(generator, HFGenerator) and generator.device.type == "cpu":
            return await generator.run_on_worker(function)
        return function()

    @property
    def deferred(self) -> bool:
        return self.weight_sync_type is not WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS

    def replica_version(self, index: int) -> int:
        return self.generators[index].policy_version

    def policy_factory(
        self, index: int, codec: Codec, sampling: SamplingParams, max_model_length: int
    ) -> Callable[[], ModelPolicy]:
        generator = self.generators[index]
        return lambda: ModelPolicy(generator, codec, sampling, max_model_length)

    def env_factory(self, env_factory: EnvFactory, index: int) -> EnvFactory:
        """``env_factory``, timed on replica ``index``'s lane when there is a timeline."""
        if self.timeline is None:
            return env_factory
        return timed_env_factory(env_factory, self.timeline, replica_lane(index))

    # --- publication ----------------------------------------------------------------------------
    async def publish(self, weights: Weights, version: int) -> None:
        """Send ``weights`` as ``version`` to every replica, as ``weight_sync_type`` says.

        In the deferred modes the tensors are read after this returns: pass a copy that the
        trainer will not change (``PolicyTrainer.export_weights(copy=True)``).
        """
        self._raise_publisher_error()
        self.version = version
        if not self.deferred:
            await asyncio.gather(*(self._update(i, weights, version) for i in range(self.size)))
            return
        if not self._publishers:
            self._publishers = [
                asyncio.create_task(self._publish_forever(i), name=f"publish-weights-{i}")
                for i in range(self.size)
            ]
        for i in range(self.size):
            self._pending[i] = (weights, version)  # replaces one that has not started
            self._wake[i].set()

    async def sleep(self) -> None:
        """Let every replica free the GPU memory it holds for the optimizer step (``Generator.sleep``).

        Lockstep only: nothing samples while the trainer steps. The next publication (or sample)
        wakes them. Async runs never call it: their replicas sample while the trainer steps.
        """
        await asyncio.gather(*(g.sleep() for g in self.generators))

    async def drop_kept_prefixes(self, indices: Sequence[int] | None = None) -> None:
        """Every replica (or those at ``indices``) drops its kept prefixes: no episode that
        sampled on it will take another turn (``Generator.drop_kept_prefixes``)."""
        chosen = range(self.size) if indices is None else indices
        await asyncio.gather(*(self.generators[i].drop_kept_prefixes() for i in chosen))

    async def load_everywhere(self, weights: Weights, version: int) -> None:
        """Load ``weights`` on every replica now, whatever the mode (a resumed run's start)."""
        self.version = version
        await asyncio.gather(*(self._update(i, weights, version) for i in range(self.size)))

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; it is checked whenever a replica changes version."""
        async with self._changed:
            while not predicate():
                self._raise_publisher_error()
                await self._changed.wait()

    async def notify(self) -> None:
        """Re-check the predicates of ``wait_for`` (the caller changed something they read)."""
        async with self._changed:
            self._changed.notify_all()

    async def flush(self) -> None:
        """Wait until every replica holds ``version`` (at once in the synchronous mode)."""
        await self.wait_for(lambda: all(self.replica_version(i) == self.version for i in range(self.size)))

    async def close(self) -> None:
        """Stop the publishers and close every generator (failing requests still in flight)."""
        for task in self._publishers:
            task.cancel()
        await asyncio.gather(*self._publishers, return_exceptions=True)
        self._publishers = []
        await asyncio.gather(*(g.close() for g in self.generators))

    async def _publish_forever(self, index: int) -> None:
        try:
            while True:
                await self._wake[index].wait()
                self._wake[index].clear()
                pending, self._pending[index] = self._pending[index], None
                if pending is not None:
                    await self._update(index, *pending)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaces in the trainer's next publish or wait
            self._error = exc
            await self.notify()

    async def _update(self, index: int, weights: Weights, version: int) -> None:
        started = time.perf_counter()
        between_requests = self.weight_sync_type is not WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE
        await self.generators[index].update_weights(weights, version, between_requests=between_requests)
        if self.timeline is not None:
            self.timeline.add(replica_lane(index), WEIGHT_SYNC, started, time.perf_counter())
        await self.notify()

    def _raise_publisher_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("publishing weights to a generator replica failed") from self._error
