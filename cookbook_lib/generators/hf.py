"""``HFGenerator``: a transformers model behind the ``Generator`` interface, batching across callers.

Callers (one asyncio task per episode) await ``sample``; their requests go into a queue. One
worker thread owns the model and loops: apply pending weight updates, admit waiting requests
(prefill them together, left-padded, and merge them into the running batch: continuous
batching), then run one batched decode step over every live row with the KV cache. Rows leave
the batch as soon as they finish, so no compute is spent on them. torch releases the GIL while
it computes, so the event loop keeps stepping environments meanwhile.

Prefix reuse (``prefix_cache.py``): the next turn of an episode starts from the KV cache that its
previous turn left, and prefills only its new tokens.

Why our own scheduler and not transformers' ``generate_batch``: measured on 2 CPU cores
(``bench/bench_generator.py``), it was slower than even one plain padded ``generate``, and it
cannot take new requests from concurrent asyncio callers or swap weights mid-flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from cookbook_lib.generators import kv_cache
from cookbook_lib.generators.base import (
    GeneratorClosedError,
    SampleResult,
    SamplingParams,
    validate_prompt,
)
from cookbook_lib.generators.batch import DecodeBatch, PrefillBatch, Request, Row
from cookbook_lib.generators.handoff import WeightUpdate, check_state_dict, deliver
from cookbook_lib.generators.prefix_cache import CachedPrefix, PrefixCache
from cookbook_lib.generators.slot_batch import SlotDecodeBatch, fixed_shape_decode_supported
from cookbook_lib.generators.stats import GeneratorStats, StepInfo, StepKind
from cookbook_lib.generators.worker import WorkerGenerator
from cookbook_lib.runtime.block_cache import block_cache_active, install_block_cache
from cookbook_lib.runtime.cpu_share import fit_threads
from cookbook_lib.runtime.memory import release_memory
from cookbook_lib.runtime.openmp_team import release_openmp_team
from cookbook_lib.runtime.packed_linear import load_weights, pack_linears
from cookbook_lib.runtime.routed_linear import release_packed_weights, route_linears, routed_linears

logger = logging.getLogger(__name__)

# The prefix cache's default token bound: room for 16 episodes of 1024 tokens between two turns
# (a GRPO step's working set on a CPU) while the samples of finished episodes age out.
DEFAULT_PREFIX_CACHE_TOKENS = 16384


class HFGenerator(WorkerGenerator):
    """Batched sampling from a transformers causal LM, on CPU or CUDA (the model's device).

    Args:
        model: the causal LM; it is not copied, so training it in place changes what is sampled.
        pad_token_id: the id put in padding positions (masked out; any valid id works).
        max_batch_size: the most rows decoded together; further requests wait in the queue.
        device: move the model there; by default it stays where it is.
        continuous_batching: admit new requests into a running batch (default). When False, or
            when the model's cache cannot be merged (sliding-window layers), requests that arrive
            mid-batch start as the next batch once the running one ends.
        step_callback: called on the worker thread after every forward with a ``StepInfo``;
            it must be quick. Errors in it are logged, never raised.
        prefix_cache_entries: the most finished samples whose KV cache is kept for prefix reuse
            (0 turns reuse off; it is off anyway for models with sliding-window or stateful
            layers). Results are the same with or without it, up to float rounding.
        prefix_cache_tokens: the most tokens kept over all those samples, or None for no bound but
            ``prefix_cache_entries``. Memory is ``2 * layers * kv_heads * head_dim * element bytes``
            per token: the default, ``DEFAULT_PREFIX_CACHE_TOKENS``, is 0.75 GB for the embedded
            model in float32. The least recently stored go first, so the samples of episodes that
            ended (nobody extends them) go before those of episodes still playing.
        fixed_shape_decode: decode in fixed-shape slots replayed as CUDA graphs (``slot_batch.py``)
            instead of a cache that grows each step. None (default): on when the model is on CUDA
            and its cache and attention allow it (full attention, sdpa or eager), since that is
            where it is faster; the CPU keeps the growing cache. True on a model that cannot
            raises ``ValueError`` with the reason. Both sample the same, up to float rounding.
        pack_weights: on a CPU, swap the model's linear layers for ones whose weights are prepacked
            for oneDNN (``runtime/packed_linear.py``): the same logits at the embedded model's sizes
            (bf16 bit for bit; float32 within rounding), a 16-row decode step's linears in about half
            (bf16, Xeon) or three quarters (float32, AMD) of the time. bf16 layers pack where the
            CPU can, float32 ones where the trainer's linears run in oneDNN too; others stay as
            they are. The model can then sample but not be trained, so pass True only for a copy
            the generator owns (``train_multi_turn``'s sampling copy is one).

    Kept prefixes hold keys and values of the current weights: ``update_weights`` drops them all,
    and samples in flight during an update are not kept (their caches mix two versions).
    ``drop_kept_prefixes`` drops them on request: ``train_multi_turn`` asks once every episode of a
    lockstep step's sampling, or of a validation, has ended, so their last turns' caches do not sit
    beside the training step or the next phase's caches. To change
    ``model``'s weights in place instead, build the generator with ``prefix_cache_entries=0``.
    """

    _worker_name = "HFGenerator"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        max_batch_size: int = 64,
        device: str | torch.device | None = None,
        continuous_batching: bool = True,
        step_callback: Callable[[StepInfo], None] | None = None,
        prefix_cache_entries: int = 64,
        prefix_cache_tokens: int | None = DEFAULT_PREFIX_CACHE_TOKENS,
        fixed_shape_decode: bool | None = None,
        pack_weights: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if device is not None:
            model = model.to(device)
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.continuous_batching = continuous_batching
        self.stats = GeneratorStats()
        output_embeddings = model.get_output_embeddings()
        self._vocab_size: int | None = (
            output_embeddings.weight.shape[0] if output_embeddings is not None else model.config.vocab_size
        )
        self._step_callback = step_callback
        if self.device.type == "cpu":
            # A prefill's and a decode step's large tensors reuse freed blocks with their pages
            # (runtime/block_cache): glibc's heap reused them too, but its holes kept the demo's
            # resident peak 0.4 GB higher.
            install_block_cache()
        if pack_weights and self.device.type == "cpu":
            pack_linears(model)  # after reading the head's shape above: a packed head has no .weight
        if self.device.type == "cpu":
            # The linears left plain (all of them on a model the trainer shares) call oneDNN, where
            # it is chosen, inside the worker's steps only, from weights packed while sampling
            # where float32 packs; sleep() and close() let those go (runtime/routed_linear.py).
            route_linears(model)
        self._prefixes = PrefixCache(prefix_cache_entries, prefix_cache_tokens)  # worker thread only
        # Keys of kept prefixes whose episodes ended (forget_prefix), from any thread; the worker
        # drops them between two steps. A deque's append and popleft are atomic.
        self._forgotten: deque[tuple[int, ...]] = deque()
        if not kv_cache.supports_reuse(model):
            self._prefixes.max_entries = 0
        keep = self._prefixes.max_entries > 0
        if fixed_shape_decode is None:
            fixed_shape_decode = fixed_shape_by_default(model, self.device)
        elif fixed_shape_decode and (reason := fixed_shape_decode_supported(model)) is not True:
            raise ValueError(
                f"fixed_shape_decode=True, but {type(model).__name__} cannot decode in fixed slots: "
                f"{reason}. Pass fixed_shape_decode=None to pick what the model allows."
            )
        batch_class: type[PrefillBatch] = SlotDecodeBatch if fixed_shape_decode else DecodeBatch
        self._batch = batch_class(model, pad_token_id=pad_token_id, device=self.device, keep_finished_kv=keep)
        self._init_worker()  # the request and weight-update queues, shared with the worker

    @property
    def fixed_shape_decode(self) -> bool:
        """Whether decode steps run in fixed-shape slots (CUDA graphs on a GPU)."""
        return isinstance(self._batch, SlotDecodeBatch)

    @property
    def num_running(self) -> int:
        """Requests being decoded now."""
        return len(self._batch)

    @property
    def num_cached_prefixes(self) -> int:
        """Finished samples whose KV cache is kept for prefix reuse."""
        return len(self._prefixes)

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        validate_prompt(prompt_tokens, self._vocab_size)
        loop = asyncio.get_running_loop()
        # Unseeded requests draw their seed from torch's global generator, so torch.manual_seed
        # before a run makes it repeatable (given the same arrival order).
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        request = Request(
            list(prompt_tokens), params, torch.Generator().manual_seed(seed), loop.create_future(), loop
        )
        self._submit(self._queue, request)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._withdraw(request)
            raise

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        check_state_dict(self.model, state_dict)  # in the caller, before the worker touches the model
        loop = asyncio.get_running_loop()
        update = WeightUpdate(state_dict, version, loop.create_future(), loop, between_requests)
        self._submit(self._controls, update)
        await update.future

    async def close(self) -> None:
        # The worker finishes its current forward, fails its rows, and exits.
        await self._stop_worker()
        # A model the generator shares outlives it: its routed layers keep no packed weights.
        release_packed_weights(self.model)

    async def sleep(self) -> None:
        """Let go of the packed weights the routed layers of a shared model keep while sampling
        (``runtime/routed_linear.py``; 0.54 GB for the embedded model in float32), for the training
        step that comes next in a lockstep run. The next step that samples packs them again."""
        if self._thread is not None:  # a worker that never started packed nothing
            await self.run_on_worker(lambda: release_packed_weights(self.model))

    async def drop_kept_prefixes(self) -> None:
        if self._thread is not None:  # a worker that never started kept nothing
            await self.run_on_worker(self._drop_prefixes)

    def forget_prefix(self, tokens: Sequence[int]) -> None:
        if self._prefixes.max_entries > 0:
            self._forgotten.append(tuple(tokens))
            with self._wake:  # an idle worker wakes to drop it; a busy one before its next step
                self._wake.notify()

    def _submit(self, queue: Any, item: Any) -> None:
        if self.device.type == "cpu":
            # The caller's thread now waits on the worker. An idle OpenMP team of its own (it ran a
            # parallel op: building this sampling copy does) would keep libgomp from spinning
            # between the worker's ops: a bf16 decode step 88 ms instead of 52 (runtime/openmp_team).
            release_openmp_team()
        super()._submit(queue, item)

    # ---- the worker thread -------------------------------------------------------------------

    def _is_busy(self) -> bool:
        return bool(self._batch.rows)

    def _has_chores(self) -> bool:
        return bool(self._forgotten)

    def _drop_cancelled(self) -> None:
        while self._forgotten:
            self._prefixes.drop(self._forgotten.popleft())
        self._retire(self._batch.remove([i for i, r in enumerate(self._batch.rows) if r.request.cancelled]))

    def _apply_control(self, control: WeightUpdate) -> None:
        self._apply_weights(control)

    def _admit(self, requests: list[Request]) -> None:
        self._prefill(requests)

    def _step(self) -> None:
        self._decode()

    def _fail_running(self, error: GeneratorClosedError) -> None:
        self._prefixes.clear()  # nothing outlives the worker: close() frees every kept cache
        for row in self._batch.clear():
            deliver(row.request.future, row.request.loop, error)

    def _take_requests(self) -> list[Request]:
        """Pop the requests that can join the batch now (called with the lock held)."""
        if not self._queue or not (
            len(self._batch) == 0 or (self.continuous_batching and self._batch.can_admit_now)
        ):
            return []
        room = self.max_batch_size - len(self._batch)
        taken: list[Request] = []
        while self._queue and len(taken) < room:
            request = self._queue.popleft()
            if not request.cancelled:
                taken.append(request)
        return taken

    def _blocks(self) -> contextlib.AbstractContextManager:
        """Where this generator's large CPU tensors come from: the block cache on a CPU."""
        return block_cache_active() if self.device.type == "cpu" else contextlib.nullcontext()

    def _drop_prefixes(self) -> None:
        if len(self._prefixes):
            self._prefixes.clear()
            # They were freed into this thread's malloc arena: hand them back to the system too.
            release_memory(full_collection=False)

    def _apply_weights(self, update: WeightUpdate) -> None:
        # Kept prefixes were computed by the old weights. Dropped on every update, even one that
        # keeps the version number: the weights may still have changed (say, a resumed run).
        self._prefixes.clear()
        for row in self._batch.rows:
            row.reusable = False
        try:
            load_weights(self.model, update.state_dict)  # copied in place; packed linears repacked
            self._version = update.version
            deliver(update.future, update.loop, None)
        except Exception as exc:
            deliver(update.future, update.loop, exc)

    def _prefill(self, requests: list[Request]) -> None:
        found = [self._prefixes.take(request.prompt_tokens) for request in requests]
        # Reusing requests feed a few tokens, the others whole prompts: prefilled together, the
        # short ones would be padded to the long ones, so each kind gets its own forward.
        for reusing in (False, True):
            group = [(r, p) for r, p in zip(requests, found, strict=True) if (p is not None) == reusing]
            if group:
                self._prefill_group([r for r, _ in group], [p for _, p in group])

    def _prefill_group(self, requests: list[Request], prefixes: list[CachedPrefix | None]) -> None:
        fit_threads(self.device)
        start = time.perf_counter()
        reused = sum(len(prefix) for prefix in prefixes if prefix is not None)
        try:
            with torch.inference_mode(), routed_linears(), self._blocks():
                finished = self._batch.admit(requests, self._version, prefixes)
        except Exception as exc:  # e.g. out of memory: these requests fail, the running batch goes on
            for request in requests:
                deliver(request.future, request.loop, exc)
            return
        fed = sum(len(request.prompt_tokens) for request in requests) - reused
        self._record("prefill", len(requests), start, fed, reused)
        self._retire(finished)

    def _decode(self) -> None:
        fit_threads(self.device)  # a shared CPU's free cores, re-read once a second
        start, rows = time.perf_counter(), len(self._batch)
        try:
            with torch.inference_mode(), routed_linears(), self._blocks():
                finished = self._batch.step(self._version)
        except Exception as exc:  # the cache may be half-updated: fail the whole batch
            for row in self._batch.clear():
                deliver(row.request.future, row.request.loop, exc)
            return
        self._record("decode", rows, start)
        self._retire(finished)

    def _record(self, kind: StepKind, rows: int, start: float, fed: int = 0, reused: int = 0) -> None:
        step = StepInfo(kind, rows, start, time.perf_counter(), self._version, fed, reused)
        self.stats.record(step)
        if self._step_callback is not None:
            try:
                self._step_callback(step)
            except Exception:
                logger.exception("HFGenerator step_callback raised; ignored")

    def _retire(self, rows: list[Row]) -> None:
        for row in rows:
            if row.prefix is not None:  # kept before the caller hears back and sends its next turn
                self._prefixes.put(row.prefix)
                row.prefix = None
            if not row.request.cancelled:
                deliver(row.request.future, row.request.loop, row.result())


def fixed_shape_by_default(model: PreTrainedModel, device: torch.device) -> bool:
    """What ``fixed_shape_decode=None`` picks: fixed slots on CUDA where the model allows them."""
    return device.type == "cuda" and fixed_shape_decode_supported(model) is True
