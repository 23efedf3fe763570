"""Fixed-shape decoding for CUDA: a slot per row in a preallocated KV cache, each step a CUDA graph.

Why: on a GPU the growing cache of ``DecodeBatch`` is launch-bound. A decode step of the embedded
model is ~30 layers of small kernels, and its tensors change shape every step (one column more,
rows joining and leaving), so nothing can be captured; on an H200 a 64-row step spent ~24 ms
launching kernels to read weights that take ~0.15 ms. Here every shape is fixed between two
admissions, so a step is recorded once as a CUDA graph and then replayed with one launch.

Layout: each row owns a slot, a row of a ``[slots, kv_heads, capacity, head_dim]`` buffer per
layer. Row ``i`` of the batch is slot ``i``. A row's tokens sit at columns ``0..n-1``, in order, so
a token's column is its position id (prefix reuse included: position ids count real tokens). A
step feeds each row's newest token, writes its keys and values at the row's own position (a
scatter) and attends to the columns at or before it (a 4D mask computed inside the step from the
positions, so it is part of the graph). Columns after a row's position hold stale values that the
mask hides.

A step runs over a bucket of slots (8, 16, 32, 64, ...), the smallest holding every live row; the
slots past the live rows compute garbage that nobody reads. One graph per bucket, captured on
first use, all in one memory pool. Capacity is a power of two from ``MIN_CAPACITY`` columns,
enough for every admitted row's prompt plus ``max_tokens`` (at most the model's context); a step
that would write past it doubles it. Growing the slots or the columns reallocates the buffers and
drops the graphs; the buffers stay between batches (for the next one), until ``clear``.

Prefill is the one both batches share, ``PrefillBatch.admit`` (one left-padded forward, its
shapes vary anyway); admitted rows are then copied into their slots. On a CPU there are no graphs and this is
slower than the growing cache (docs/benchmarks.md), so ``HFGenerator`` uses it on CUDA only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from cookbook_lib.generators import kv_cache
from cookbook_lib.generators.batch import PrefillBatch, Row
from cookbook_lib.generators.prefix_cache import CachedPrefix

logger = logging.getLogger(__name__)

MIN_CAPACITY = 256  # columns per slot at first: most turns fit, and growth is by doubling
MIN_BUCKET = 8  # the smallest number of slots a step runs over
# Attention implementations that take our 4D mask as it is: a bool mask for sdpa, additive for eager.
SUPPORTED_ATTENTION = ("sdpa", "eager")


def fixed_shape_decode_supported(model: PreTrainedModel) -> Literal[True] | str:
    """True when ``SlotDecodeBatch`` can decode ``model``, else the reason it cannot (a sentence)."""
    if not kv_cache.supports_reuse(model):
        return (
            "its KV cache has layers other than plain full attention (sliding window or linear "
            "attention), which keep only part of a row's history and cannot sit in fixed slots"
        )
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        return (
            f"its attention implementation is {attention!r}; fixed-shape decoding passes a 4D mask, "
            f"which only {' and '.join(SUPPORTED_ATTENTION)} take (load it with attn_implementation='sdpa')"
        )
    return True


def bucket_for(rows: int) -> int:
    """The smallest power of two >= ``rows`` and >= ``MIN_BUCKET``: the slots a step runs over."""
    return max(MIN_BUCKET, 1 << max(rows - 1, 0).bit_length())


def capacity_for(columns: int, limit: int | None) -> int:
    """Columns to allocate for ``columns`` needed: a power of two >= ``MIN_CAPACITY``, at most
    ``limit`` (the model's context) unless ``columns`` itself is more."""
    capacity = max(MIN_CAPACITY, 1 << max(columns - 1, 0).bit_length())
    if limit is not None and columns <= limit:
        capacity = min(capacity, limit)
    return capacity


class SlotLayer(DynamicLayer):
    """One layer's slots: ``keys`` and ``values`` are the whole ``[slots, heads, capacity, dim]``
    buffers; ``update`` writes the step's keys at each row's position and returns the bucket's slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, step: StaticInputs) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.step = keys, values, step

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = key_states.shape[0]
        keys, values = self.keys[:rows], self.values[:rows]
        # scatter_, not advanced indexing: a fixed-shape kernel with no host sync, so it can be captured.
        index = self.step.positions_S[:rows].view(rows, 1, 1, 1).expand(key_states.shape)
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys, values


class StaticInputs:
    """The inputs of a step that a graph reads (token ids and positions, one per slot), shared by
    the batch and its layers: they are written in place, never replaced."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.input_ids_S = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions_S = torch.zeros(slots, dtype=torch.long, device=device)


class SlotDecodeBatch(PrefillBatch):
    """A batch whose decode steps have fixed shapes (see the module docstring); it shares the
    prefill with :class:`~cookbook_lib.generators.batch.DecodeBatch`.

    ``use_cuda_graphs`` (default: on for a CUDA device) captures each bucket's step once and
    replays it; if a capture fails, one warning is logged and every later step runs eagerly.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        device: torch.device,
        keep_finished_kv: bool = False,
        use_cuda_graphs: bool | None = None,
    ) -> None:
        supported = fixed_shape_decode_supported(model)
        if supported is not True:
            raise ValueError(f"fixed-shape decoding cannot run {type(model).__name__}: {supported}")
        super().__init__(model, pad_token_id=pad_token_id, device=device, keep_finished_kv=keep_finished_kv)
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._additive_mask = model.config._attn_implementation == "eager"
        self._context_limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self._slots: Cache | None = None
        self._layer_shapes: list[tuple[int, int, torch.dtype]] = []  # (kv_heads, head_dim, dtype) per layer
        self._shape: StaticInputs | None = None
        self._columns_C = torch.zeros(0, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def can_admit_now(self) -> bool:
        return True  # a new row only needs a free slot

    @property
    def columns(self) -> int:
        return self._columns_C.shape[0]

    @property
    def slots(self) -> int:
        return self._shape.positions_S.shape[0] if self._shape is not None else 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _reserve(self, rows: int, columns: int) -> None:
        """Make room for ``rows`` slots of ``columns`` columns, keeping what the slots hold."""
        slots = max(self.slots, bucket_for(rows))
        capacity = max(self.columns, capacity_for(columns, self._context_limit))
        if slots == self.slots and capacity == self.columns:
            return
        old = self._slots
        shape = StaticInputs(slots, self.device)
        layers = []
        for index, (heads, dim, dtype) in enumerate(self._layer_shapes):
            pair = []
            for name in ("keys", "values"):
                buffer = torch.zeros(slots, heads, capacity, dim, dtype=dtype, device=self.device)
                if old is not None:
                    previous = getattr(old.layers[index], name)
                    buffer[: previous.shape[0], :, : previous.shape[2]] = previous
                pair.append(buffer)
            layers.append(SlotLayer(pair[0], pair[1], shape))
        if self._shape is not None:
            shape.input_ids_S[: self.slots] = self._shape.input_ids_S
        self._slots, self._shape = Cache(layers=layers), shape
        self._columns_C = torch.arange(capacity, device=self.device)
        self._graphs.clear()  # they read the old buffers
        self._graph_pool = None  # a fresh pool: the old one is freed with its graphs

    def _columns_wanted(self, row: Row) -> int:
        """The columns a row would need to reach ``max_tokens``, at most the model's context (so a
        huge ``max_tokens`` does not reserve memory it will hardly use; a row that goes past the
        context makes ``step`` grow the slots), and always its prompt and first sampled token."""
        wanted = len(row.request.prompt_tokens) + row.request.params.max_tokens
        if self._context_limit is not None:
            wanted = min(wanted, max(self._context_limit, row.position + 1))
        return wanted

    # ---- admission, steps, removal -----------------------------------------------------------

    def _join(
        self, cache: DynamicCache, mask_BL: torch.Tensor, last_B: torch.Tensor, rows: list[Row]
    ) -> None:
        """Copy the prefilled rows into the slots after the live ones, their tokens at columns 0..n-1."""
        first = len(self.rows)
        if not self._layer_shapes:  # read off what the model wrote, rather than guessed from its config
            self._layer_shapes = [
                (layer.keys.shape[1], layer.keys.shape[3], layer.keys.dtype) for layer in cache.layers
            ]
        self._reserve(first + len(rows), max(map(self._columns_wanted, rows)))
        assert self._slots is not None
        # The columns of each row's real tokens, in order, then its padding (never read).
        order_BL = torch.sort(mask_BL, dim=1, descending=True, stable=True).indices
        width = int(mask_BL.sum(dim=1).max())
        order_BL = order_BL[:, :width]
        for mine, theirs in zip(self._slots.layers, cache.layers, strict=True):
            index = order_BL[:, None, :, None].expand(-1, theirs.keys.shape[1], -1, theirs.keys.shape[3])
            mine.keys[first : first + len(rows), :, :width] = theirs.keys.gather(2, index)
            mine.values[first : first + len(rows), :, :width] = theirs.values.gather(2, index)
        self.rows = self.rows + rows
        self._last_tokens_B = torch.cat([self._last_tokens_B, last_B])

    def step(self, version: int) -> list[Row]:
        assert self._slots is not None and self._shape is not None and self.rows, "step() on an empty batch"
        live = len(self.rows)
        # A row writes at its position: the slots need a column past the furthest one.
        self._reserve(live, max(row.position for row in self.rows) + 1)
        bucket = bucket_for(live)
        shape = self._shape
        shape.input_ids_S[:live] = self._last_tokens_B
        positions = [row.position for row in self.rows] + [0] * (bucket - live)
        shape.positions_S[:bucket] = torch.tensor(positions).to(self.device, non_blocking=True)
        logits_BV = self._run(bucket)[:live]
        self._last_tokens_B = self._sample(self.rows, logits_BV, version)
        self._keep_slot_kv()
        return self.remove([i for i, row in enumerate(self.rows) if row.finish_reason is not None])

    def remove(self, indices: list[int]) -> list[Row]:
        """Take rows out; the rows after them move down into the freed slots (the buffers stay)."""
        if not indices:
            return []
        removed, keep = self._partition(indices)
        if keep != list(range(len(keep))):
            assert self._slots is not None
            index = torch.tensor(keep, device=self.device)
            # The buffers were made in inference mode (prefill and steps run in it); the generator
            # also removes cancelled rows outside it.
            with torch.inference_mode():
                for layer in self._slots.layers:
                    # index_select copies first, so overlapping source and destination slots are safe.
                    layer.keys[: len(keep)] = layer.keys.index_select(0, index)
                    layer.values[: len(keep)] = layer.values.index_select(0, index)
            self._last_tokens_B = self._last_tokens_B[index]
        else:
            self._last_tokens_B = self._last_tokens_B[: len(keep)]
        self.rows = [self.rows[i] for i in keep]
        return removed

    def clear(self) -> list[Row]:
        """Drop every row, the slots and the graphs (after an error, or on shutdown)."""
        removed = self._clear_rows()
        self._slots, self._shape, self._graph_pool, self._layer_shapes = None, None, None, []
        self._graphs.clear()
        self._columns_C = self._columns_C[:0]
        return removed

    def _keep_slot_kv(self) -> None:
        """Copy out the keys and values of the rows that just finished, if they are to be kept.

        A row's slot holds its prompt and its sampled tokens but the last at columns 0..position-1.
        """
        if not self.keep_finished_kv:
            return
        assert self._slots is not None
        for i, row in enumerate(self.rows):
            if row.finish_reason is not None and row.reusable and not row.request.cancelled:
                tokens = (*row.request.prompt_tokens, *row.tokens[:-1])
                if row.position != len(tokens):
                    raise RuntimeError(f"row slot holds {row.position} tokens, expected {len(tokens)}")
                end = len(tokens)
                layers = [
                    (layer.keys[i : i + 1, :, :end].clone(), layer.values[i : i + 1, :, :end].clone())
                    for layer in self._slots.layers
                ]
                row.prefix = CachedPrefix(tokens, layers)

    # ---- the forward, eager or replayed --------------------------------------------------------

    def _forward(self, bucket: int) -> torch.Tensor:
        """One decode forward over the first ``bucket`` slots; returns the logits ``[bucket, vocab]``.

        Everything it reads is a static tensor, so it can be captured as it is.
        """
        assert self._shape is not None
        positions_S = self._shape.positions_S[:bucket]
        visible_SC = self._columns_C[None, :] <= positions_S[:, None]
        mask = visible_SC[:, None, None, :]
        if self._additive_mask:  # eager attention adds its mask to the scores, in the keys' dtype
            dtype = self._layer_shapes[0][2]
            mask = torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        output = self.model(
            input_ids=self._shape.input_ids_S[:bucket, None],
            attention_mask=mask,
            position_ids=positions_S[:, None],
            use_cache=True,
            **{self._cache_keyword: self._slots},
        )
        return output.logits[:, -1]

    def _run(self, bucket: int) -> torch.Tensor:
        if not self.use_cuda_graphs:
            return self._forward(bucket)
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = self._capture(bucket, lambda: self._forward(bucket))
            except Exception as exc:  # the model did something a graph cannot hold: decode eagerly
                logger.warning(
                    "CUDA graph capture of a decode step failed (%s: %s); decoding without graphs, "
                    "which is slower but samples the same",
                    type(exc).__name__,
                    exc,
                )
                self.use_cuda_graphs = False
                self._graphs.clear()
                return self._forward(bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits

    def _capture(
        self, bucket: int, forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record ``forward`` as a CUDA graph; returns it with its output tensor (rewritten by each replay).

        The warm-up runs on a side stream first, as torch asks (lazy inits, cuBLAS workspaces). It
        writes the current step's keys, which the replay then writes again, identically.
        """
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer may use the GPU from another thread while this one captures.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            logits = forward()
        return graph, logits
