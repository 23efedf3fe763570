"""Generator replicas as Ray actors (``GRPOConfig.generator_placement="ray"``), behind ``Generator``.

Each replica is one Ray actor holding its own ``HFGenerator`` and model copy: on a GPU machine a
GPU each (a Ray started for the run offers every GPU but the trainer's, ``gpu_plan``), otherwise a
CPU actor with ``cpus_per_replica`` cores and as many torch threads. The driver sees a
``RayGenerator`` per replica, so ``GeneratorReplicas``, the three weight-sync modes, per-token
policy versions and the timeline work unchanged.

How things travel:

- The model: the sampling copy is moved to CPU memory and ``ray.put`` once; every actor builds its
  generator from that one object (and moves it to its GPU when it has one), so actors need no
  access to the model files.
- Weights: ``RayReplicaPool.put_weights`` moves the trainer's state dict to CPU memory and
  ``ray.put``s it once per publication; every actor's ``update_weights`` receives the same
  reference and Ray copies it out of the shared-memory object store into the actor, which loads it
  into its model (on a GPU, a host-to-device copy). There is no GPU-to-GPU path (NCCL): measured
  nowhere here, as this project has no multi-GPU machine.
- Seeds: an unseeded request draws its seed in the driver from torch's global generator, as
  ``HFGenerator`` does, so a seeded run samples the same tokens with local or Ray replicas.
- Timeline: each actor keeps its forward passes (``StepInfo``) and hands them back with every
  reply; the driver shifts them onto its own clock (an offset measured once at start) and passes
  them to the replica's ``step_callback``.

Failures: a request to an actor that died raises ``ReplicaLostError`` (a plain ``RuntimeError``),
so its episode ends as ``ERROR``; later requests and weight updates of that replica go to the next
live replica. When none is left, ``AllReplicasLostError`` (a ``GeneratorClosedError``) stops the
run with the names of the lost replicas. ``RayReplicaPool.shutdown`` kills every actor it created
and stops a Ray it started; ``train_multi_turn`` calls it in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel

from cookbook_lib.generators.base import (
    Generator,
    GeneratorClosedError,
    SampleResult,
    SamplingParams,
    validate_prompt,
)
from cookbook_lib.generators.stats import GeneratorStats, StepInfo
from cookbook_lib.runtime.progress import progress_bar

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = 'pip install -e ".[ray]"'
# How long actors may take to start and load their model before the run stops with a message
# (an actor that cannot be placed, e.g. a cluster without free CPUs or GPUs, would otherwise wait).
ACTOR_START_TIMEOUT_S = 600.0
MIN_OBJECT_STORE_BYTES = 128 * 1024**2
ACTOR_NAME_PREFIX = "cookbook-generator-"


class ReplicaLostError(RuntimeError):
    """A generator replica's actor died with this request in flight; the episode ends as ``ERROR``."""


class AllReplicasLostError(GeneratorClosedError):
    """Every replica's actor died: the run cannot sample any more and stops."""


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"generator_placement='ray' needs Ray, which is not installed: {RAY_INSTALL_HINT}, "
            "or use generator_placement='local'"
        ) from exc
    return ray


def start_local_ray(ray: Any, attempts: int = 3, **settings: Any) -> None:
    """``ray.init(**settings)`` for a new local Ray, tried again if its start-up fails.

    On an overloaded machine Ray's own processes can miss their start-up deadlines (measured here:
    the raylet gave up waiting for its metrics agent after 30 s while other jobs held both cores),
    and a second try usually starts.
    """
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**settings)
            return
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == attempts:
                raise RuntimeError(
                    f"a local Ray did not start ({attempts} tries; last: {type(exc).__name__}: {exc}). "
                    "Is the machine overloaded? Retry, join a running cluster with ray_address (or "
                    "RAY_ADDRESS), or use generator_placement='local'"
                ) from exc
            logger.warning("a local Ray did not start (%s); trying again", exc)


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def gpu_plan(visible: Sequence[str], trainer_index: int, count: int) -> tuple[list[str], float]:
    """The GPUs a Ray started for a run hands its ``count`` actors, and each actor's share.

    Every visible GPU but the trainer's when there is one for each replica (sampling never shares
    a device with training); otherwise all of them, shared evenly (``num_gpus`` below 1).
    """
    others = [gpu for i, gpu in enumerate(visible) if i != trainer_index]
    if len(others) >= count:
        return others, 1.0
    return list(visible), 1.0 / -(-count // len(visible))


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _gpu_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _ReplicaActor:
    """The actor: an ``HFGenerator`` on this process's device, and the forward passes it recorded."""

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        threads: int | None,
        use_gpu: bool,
        cuda_graphs: bool = True,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        from cookbook_lib.generators.hf import HFGenerator

        self._steps: deque[StepInfo] = deque()  # appended by the worker thread, drained by replies
        device = "cuda" if use_gpu else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.generator = HFGenerator(
            model.to(device).eval(),
            pad_token_id=pad_token_id,
            step_callback=self._steps.append,
            fixed_shape_decode=None if cuda_graphs else False,
            pack_weights=True,  # the actor's own copy of the sampling model
        )

    def _drain(self) -> list[StepInfo]:
        out = []
        while self._steps:
            out.append(self._steps.popleft())
        return out

    async def clock(self) -> float:
        return time.perf_counter()

    async def sample(self, prompt: list[int], params: SamplingParams) -> tuple[SampleResult, list[StepInfo]]:
        result = await self.generator.sample(prompt, params)
        return result, self._drain()

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, between_requests: bool
    ) -> list[StepInfo]:
        await self.generator.update_weights(state_dict, version, between_requests=between_requests)
        return self._drain()

    async def drop_kept_prefixes(self) -> list[StepInfo]:
        await self.generator.drop_kept_prefixes()
        return self._drain()

    async def close(self) -> None:
        await self.generator.close()


class RayReplicaPool:
    """The actors of one run: starts (or joins) Ray, creates them, tracks which died, cleans up.

    Args:
        model: the sampling model (dtype as sampled); it is copied to the object store once.
        pad_token_id: as for ``HFGenerator``.
        count: replicas (actors).
        address: a Ray cluster to join (``None``: ``RAY_ADDRESS`` if set, else a local Ray is
            started, sized to this machine; a Ray already initialised in this process is used as is).
        cpus_per_replica: CPU actors' cores (Ray's ``num_cpus``) and torch threads.
        trainer_gpu: the trainer's CUDA device on a GPU machine (None on a CPU): actors then get
            GPUs instead of CPU threads. A Ray started here gives them every visible GPU but this
            one, one each, when there are enough (``gpu_plan``); a joined cluster, one GPU each.
        cuda_graphs: False keeps the actors' generators on the growing KV cache on a GPU too
            (``GRPOConfig.cuda_graphs``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        count: int,
        *,
        address: str | None = None,
        cpus_per_replica: int = 1,
        trainer_gpu: torch.device | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.ray = import_ray()
        self.count = count
        self.names = [f"{ACTOR_NAME_PREFIX}{i}-{uuid.uuid4().hex[:8]}" for i in range(count)]
        self.started_ray = False
        self.closed = False
        self.dead: dict[int, str] = {}  # replica -> why
        self.versions = [0] * count  # what each actor holds, as its last reply said
        self.clock_offsets = [0.0] * count  # driver perf_counter - actor perf_counter
        self._weights: tuple[Mapping[str, torch.Tensor], int, asyncio.Future[Any]] | None = None
        self._generators: list[RayGenerator] = []
        head = model.get_output_embeddings()
        self.vocab_size = head.weight.shape[0] if head is not None else model.config.vocab_size
        use_gpus = trainer_gpu is not None
        self.gpus_per_replica = 1.0
        self._connect(
            address, bytes_needed=model_bytes(model), cpus=cpus_per_replica, trainer_gpu=trainer_gpu
        )
        try:
            model_ref = self.ray.put(model.to("cpu"))
            actor_class = self.ray.remote(_ReplicaActor)
            resources = (
                {"num_gpus": self.gpus_per_replica, "num_cpus": 1}
                if use_gpus
                else {"num_cpus": cpus_per_replica}
            )
            self.actors = [
                actor_class.options(name=name, max_restarts=0, **resources).remote(
                    model_ref, pad_token_id, None if use_gpus else cpus_per_replica, use_gpus, cuda_graphs
                )
                for name in self.names
            ]
            self._wait_until_started()
            del model_ref  # every actor holds its copy now: the object store may free it
        except BaseException:
            self.shutdown()
            raise

    # --- set-up ---------------------------------------------------------------------------------
    def _connect(
        self, address: str | None, *, bytes_needed: int, cpus: int, trainer_gpu: torch.device | None
    ) -> None:
        ray = self.ray
        if ray.is_initialized():
            return  # the caller's Ray (a notebook's, the tests'): theirs to shut down
        address = address or os.environ.get("RAY_ADDRESS")
        quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            # The model once, one publication in flight and the next, plus room: a small store
            # (the default takes 30% of the machine's memory).
            store = max(MIN_OBJECT_STORE_BYTES, 3 * bytes_needed + 64 * 1024**2)
            num_cpus = max(os.cpu_count() or 1, self.count * cpus)
            if trainer_gpu is None:
                start_local_ray(ray, num_cpus=num_cpus, object_store_memory=store, **quiet)
            else:
                gpus, self.gpus_per_replica = gpu_plan(_visible_gpus(), _gpu_index(trainer_gpu), self.count)
                # Ray hands its actors the GPUs it saw at start: show it only those (the trainer's
                # own CUDA context is made already, so this process keeps seeing every GPU).
                saved = os.environ.get("CUDA_VISIBLE_DEVICES")
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
                try:
                    start_local_ray(
                        ray, num_cpus=num_cpus, num_gpus=len(gpus), object_store_memory=store, **quiet
                    )
                finally:
                    if saved is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.started_ray = True

    def _wait_until_started(self) -> None:
        """Ping every actor (its model loaded) and measure its clock against ours."""
        t0 = time.perf_counter()
        refs = [actor.clock.remote() for actor in self.actors]
        pending = list(refs)
        # Actors take 10-30 s to start and copy the model in: a bar counts them in.
        with progress_bar("starting Ray generator replicas", total=len(refs), unit="actor") as bar:
            while pending and (left := ACTOR_START_TIMEOUT_S - (time.perf_counter() - t0)) > 0:
                ready, pending = self.ray.wait(pending, num_returns=1, timeout=left)
                bar.update(len(ready))
        if pending:
            missing = [self.names[refs.index(r)] for r in pending]
            raise RuntimeError(
                f"Ray generator replicas {missing} did not start within {ACTOR_START_TIMEOUT_S:.0f} s: the "
                f"cluster may lack free resources ({self.ray.available_resources()}); lower "
                "num_generator_replicas or ray_cpus_per_replica, or add machines"
            )
        t1 = time.perf_counter()
        for i, actor_now in enumerate(self.ray.get(refs)):
            self.clock_offsets[i] = (t0 + t1) / 2 - actor_now

    # --- routing and failures -------------------------------------------------------------------
    def target(self, index: int) -> int | None:
        """The replica that serves ``index``'s requests: itself, or the next live one."""
        for k in range(self.count):
            candidate = (index + k) % self.count
            if candidate not in self.dead:
                return candidate
        return None

    def mark_dead(self, index: int, exc: BaseException) -> None:
        if index in self.dead or self.closed:
            return
        self.dead[index] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        live = [i for i in range(self.count) if i not in self.dead]
        logger.warning(
            "generator replica %d (Ray actor %s) died; %s",
            index,
            self.names[index],
            f"going on with replicas {live}" if live else "no replica is left",
        )

    def lost_error(self) -> AllReplicasLostError:
        lost = ", ".join(f"replica {i} (Ray actor {self.names[i]}: {why})" for i, why in self.dead.items())
        return AllReplicasLostError(f"every generator replica died, so the run stops: {lost}")

    # --- weights ----------------------------------------------------------------------------------
    async def put_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> Any:
        """One object-store copy per publication, shared by every replica's update."""
        if self._weights is None or self._weights[0] is not weights or self._weights[1] != version:
            cpu = {name: t.detach().to("cpu") for name, t in weights.items()}  # no copy on a CPU
            # Keep ``weights`` referenced so its identity cannot be reused by a newer dict.
            self._weights = (weights, version, asyncio.ensure_future(asyncio.to_thread(self.ray.put, cpu)))
        return await asyncio.shield(self._weights[2])

    # --- shutdown ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every actor of this pool; stop or leave the Ray this pool started (idempotent)."""
        self.closed = True
        for actor in getattr(self, "actors", []):
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        self.actors = []
        self._weights = None
        if self.started_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self.started_ray = False

    def generators(
        self, step_callbacks: Sequence[Callable[[StepInfo], None] | None] | None = None
    ) -> list[RayGenerator]:
        callbacks = list(step_callbacks) if step_callbacks is not None else [None] * self.count
        self._generators = [
            RayGenerator(self, i, step_callback=callbacks[i], vocab_size=self.vocab_size)
            for i in range(self.count)
        ]
        return list(self._generators)

    def record(self, index: int, steps: list[StepInfo]) -> None:
        """Actor ``index``'s forward passes, onto its replica's stats and lane (whoever asked)."""
        if index < len(self._generators):
            self._generators[index].absorb(steps)


class RayGenerator(Generator):
    """Replica ``index`` of a ``RayReplicaPool``, behind the ``Generator`` interface."""

    def __init__(
        self,
        pool: RayReplicaPool,
        index: int,
        *,
        step_callback: Callable[[StepInfo], None] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.stats = GeneratorStats()
        self._step_callback = step_callback
        self._vocab_size = vocab_size
        self._closed = False

    @property
    def policy_version(self) -> int:
        # A lost replica's requests go to another one, so it reports what that one holds.
        target = self.pool.target(self.index)
        return self.pool.versions[self.index if target is None else target]

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        validate_prompt(prompt_tokens, self._vocab_size)
        # Drawn here, as HFGenerator draws it, so seeded runs match local replicas.
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        target = self._target()
        result, steps = await self._call(target, "sample", list(prompt_tokens), replace(params, seed=seed))
        self.pool.record(target, steps)
        return result

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        target = self._target()
        if target != self.index:  # lost: the live replica it falls back on gets its own updates
            return
        ref = await self.pool.put_weights(state_dict, version)
        try:
            steps = await self._call(target, "update_weights", ref, version, between_requests)
        except ReplicaLostError:
            if self.pool.target(self.index) is None:
                raise self.pool.lost_error() from None
            return
        self.pool.versions[target] = version
        self.pool.record(target, steps)

    async def drop_kept_prefixes(self) -> None:
        # Only memory is at stake: a lost or closed replica keeps nothing, and sample reports losses.
        with contextlib.suppress(ReplicaLostError, GeneratorClosedError):
            target = self._target()
            if target == self.index:  # else lost: its fallback is told by its own RayGenerator
                self.pool.record(target, await self._call(target, "drop_kept_prefixes"))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.index in self.pool.dead or not self.pool.actors:
            return
        with contextlib.suppress(Exception):  # a dead or killed actor has nothing left to close
            await self.pool.actors[self.index].close.remote()

    def _target(self) -> int:
        if self._closed or self.pool.closed:
            raise GeneratorClosedError("the generator is closed")
        target = self.pool.target(self.index)
        if target is None:
            raise self.pool.lost_error()
        return target

    async def _call(self, target: int, method: str, *args: object) -> Any:
        ray = self.pool.ray
        ref = getattr(self.pool.actors[target], method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # the actor's task is cancelled, which drops the request
            raise
        except ray.exceptions.RayActorError as exc:
            if self._closed or self.pool.closed:
                raise GeneratorClosedError("the generator was closed") from exc
            self.pool.mark_dead(target, exc)
            if self.pool.target(self.index) is None:
                raise self.pool.lost_error() from exc
            raise ReplicaLostError(
                f"generator replica {target} (Ray actor {self.pool.names[target]}) died with this "
                "request in flight"
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            raise cause from None

    def absorb(self, steps: list[StepInfo]) -> None:
        """This replica's actor's forward passes, shifted onto the driver's clock."""
        offset = self.pool.clock_offsets[self.index]
        for step in steps:
            shifted = replace(step, start_s=step.start_s + offset, end_s=step.end_s + offset)
            self.stats.record(shifted)
            if self._step_callback is not None:
                try:
                    self._step_callback(shifted)
                except Exception:
                    logger.exception("step_callback failed")
