"""The generator's KV cache: a transformers ``DynamicCache`` whose layers grow in place
(``SlackLayer``), and the row and column surgery continuous batching does on it.

Every layer of the cache holds keys and values shaped ``[rows, kv_heads, columns, head_dim]``, all
rows left-padded to the same number of columns; the 2D attention mask (kept by the batch) says
which columns of a row are real. Padding columns are zeros that the mask hides, so adding or
removing them never changes what a row attends to.

Only plain full-attention layers (``DynamicLayer``) can be padded, merged and trimmed this way;
sliding-window and linear-attention layers keep extra state. ``supports_merging`` tells which
caches qualify; the others still batch, but new requests wait for the running batch to end. The
same layers are the only ones whose rows can be copied out and stacked back for prefix reuse
(``extract_row``, ``stack_rows``; ``supports_reuse`` tells whether a model's caches qualify).

Across the transformers versions we support (the range in pyproject.toml) this module relies on
``DynamicCache(config=...)``, ``Cache.batch_select_indices``, ``cache.layers`` and each
``DynamicLayer``'s ``keys``, ``values``, ``is_initialized`` and ``lazy_initialization``, unchanged
over that range. What did change is the name under which a model's ``forward`` takes the cache:
see ``cache_keyword``.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

# One layer's (keys, values) for one row, each ``[1, kv_heads, tokens, head_dim]``, no padding.
LayerKV = tuple[torch.Tensor, torch.Tensor]


# The keyword a model's forward takes its KV cache under: ``cache`` from transformers 5.24 on,
# ``past_key_values`` before. Newest first.
_CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(model: PreTrainedModel) -> str:
    """The name under which ``model.forward`` takes a KV cache, read from its signature.

    The name matters: transformers before 5.24 takes ``past_key_values`` and silently drops an
    unknown ``cache=`` into its ``**kwargs`` (the cache then stays empty), while 5.24 takes
    ``cache`` and still accepts ``past_key_values`` with a deprecation warning.
    """
    parameters = inspect.signature(model.forward).parameters
    for name in _CACHE_KEYWORDS:
        if name in parameters:
            return name
    raise TypeError(
        f"{type(model).__name__}.forward takes its KV cache under neither of {_CACHE_KEYWORDS}; "
        "HFGenerator needs a transformers causal LM (AutoModelForCausalLM) whose forward accepts one. "
        "Pass the plain model, not a wrapper around it, or use a transformers version from the range "
        "in pyproject.toml."
    )


class SlackLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with spare columns.

    ``DynamicLayer.update`` concatenates: every decode step copies the layer's whole cache to add
    one column. On the embedded model at 16 rows x ~450 columns that is ~300 MB copied per step,
    each layer's new tensor faulted in fresh from the OS: measured on a 2-core AMD EPYC, 100 of a
    step's 290 ms (on a 2-core Xeon, 4 of 72). Here a step writes its columns into the buffer's
    spare ones, and only a step that finds no room copies, into a buffer ``SLACK_FRACTION`` larger
    (at least ``MIN_SLACK_COLUMNS``): a copy every ~L/8 steps, for at most ~1/8 more cache memory.

    The keys are ``buffer[:, :, :columns]``, so everything that reads them (attention, the row
    and column surgery below) sees exactly the tensors it saw before. ``merge`` and ``stack_rows``
    build such buffers too; whatever else replaced them with a tensor of its own (``select_rows``,
    ``drop_leading_columns``) simply has no spare columns, and the next update copies it into a new
    buffer.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.numel() == 0:  # the first update (a prefill): nothing to keep
            self.keys, self.values = _with_room(key_states), _with_room(value_states)
        else:
            self.keys, self.values = _appended(self.keys, key_states), _appended(self.values, value_states)
        return self.keys, self.values


MIN_SLACK_COLUMNS = 32
SLACK_FRACTION = 8  # spare columns: 1/8 of the columns in use


def _spare_columns(tensor: torch.Tensor) -> int:
    """How many columns past ``tensor``'s last one its storage holds for it (0 unless it is the
    leading-columns view of a ``[rows, heads, capacity, head_dim]`` buffer)."""
    rows, heads, columns, head_dim = tensor.shape
    capacity = tensor.stride(1) // head_dim if head_dim else 0
    layout = (heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
    if tensor.storage_offset() != 0 or tensor.stride() != layout or capacity <= columns:
        return 0
    if tensor.untyped_storage().nbytes() < rows * heads * capacity * head_dim * tensor.element_size():
        return 0
    return capacity - columns


def _capacity(columns: int) -> int:
    """The columns a new buffer holds for ``columns`` in use: the slack the next steps write into."""
    return columns + max(MIN_SLACK_COLUMNS, columns // SLACK_FRACTION)


def _with_room(states: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """A new buffer holding ``kept`` then ``states`` along the columns, with slack after them."""
    old = 0 if kept is None else kept.shape[2]
    columns = old + states.shape[2]
    capacity = _capacity(columns)
    buffer = states.new_empty((*states.shape[:2], capacity, states.shape[3]))
    if kept is not None:
        buffer[:, :, :old].copy_(kept)
    buffer[:, :, old:columns].copy_(states)
    return buffer[:, :, :columns]


def _appended(kept: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``torch.cat([kept, states], dim=2)``, written in place into ``kept``'s spare columns when
    it has enough."""
    old, new = kept.shape[2], states.shape[2]
    if _spare_columns(kept) < new or kept.shape[:2] != states.shape[:2]:
        return _with_room(states, kept)
    rows, heads, _, head_dim = kept.shape
    full = kept.as_strided((rows, heads, old + new, head_dim), kept.stride())
    full[:, :, old:].copy_(states)
    return full


# The layers whose rows and columns this module can pad, merge and trim: plain full attention.
PLAIN_LAYERS = (DynamicLayer, SlackLayer)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model``, its plain full-attention layers growing in place (``SlackLayer``)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [SlackLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def is_filled(cache: DynamicCache) -> bool:
    """Whether a forward wrote keys and values into ``cache`` (a forward that ignored it wrote none)."""
    return any(layer.is_initialized for layer in cache.layers)


def supports_merging(cache: DynamicCache) -> bool:
    return all(type(layer) in PLAIN_LAYERS and layer.is_initialized for layer in cache.layers)


def supports_reuse(model: PreTrainedModel) -> bool:
    """Whether every layer of the model's cache is plain full attention (no window, no state)."""
    layers = new_cache(model).layers
    return bool(layers) and all(type(layer) in PLAIN_LAYERS for layer in layers)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` (indices into the batch dimension), in that order."""
    cache.batch_select_indices(rows)


def _stacked(parts: list[torch.Tensor], width: int, room: int = 0) -> torch.Tensor:
    """``parts`` (each ``[rows_i, kv_heads, columns_i, head_dim]``) one under the other, each
    right-aligned in ``width`` columns (zeros before the shorter ones): the leading columns of a new
    buffer with ``room`` spare columns and the usual slack after them.

    ``torch.cat`` of left-padded parts would build each padded part, then the result, and leave no
    spare columns, so the next forward would copy the whole layer once more: here each part is
    copied once, and a forward of up to ``room`` tokens (a prefill after a kept prefix) or the next
    decode steps write in place.
    """
    first = parts[0]
    capacity = _capacity(width + room)
    buffer = first.new_empty((sum(part.shape[0] for part in parts), first.shape[1], capacity, first.shape[3]))
    start = 0
    for part in parts:
        rows, padding = part.shape[0], width - part.shape[2]
        buffer[start : start + rows, :, :padding].zero_()
        buffer[start : start + rows, :, padding:width].copy_(part)
        start += rows
    return buffer[:, :, :width]


def merge(first: DynamicCache, second: DynamicCache) -> None:
    """Append the rows of ``second`` after those of ``first`` (in place), right-aligning columns.

    The shorter of the two is left-padded with zero columns; the caller pads its masks the same.
    """
    for mine, theirs in zip(first.layers, second.layers, strict=True):
        width = max(mine.keys.shape[2], theirs.keys.shape[2])
        mine.keys = _stacked([mine.keys, theirs.keys], width)
        mine.values = _stacked([mine.values, theirs.values], width)


def drop_leading_columns(cache: DynamicCache, columns: int) -> None:
    """Remove the first ``columns`` columns of every row: they must be padding in all rows.

    After the longest rows finish, the others are left with columns no row attends to; dropping
    them keeps each decode step's attention as short as the longest live row.
    """
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, columns:]
        layer.values = layer.values[:, :, columns:]


def extract_row(cache: DynamicCache, row: int, columns: torch.Tensor) -> list[LayerKV]:
    """Copy the keys and values of one row at ``columns`` (its real ones), one entry per layer.

    A copy, not a view: a view would keep the whole batch's cache tensors alive.
    """
    return [
        (
            layer.keys[row : row + 1].index_select(2, columns),
            layer.values[row : row + 1].index_select(2, columns),
        )
        for layer in cache.layers
    ]


def stack_rows(
    model: PreTrainedModel, rows: list[list[LayerKV]], *, room: int = 0, release: bool = False
) -> DynamicCache:
    """A new cache holding ``rows`` one under the other, each right-aligned (left-padded with zeros),
    with ``room`` spare columns after them: a forward of up to ``room`` tokens writes in place.

    The caller's attention mask must mark, for row ``i``, its last ``tokens_i`` columns as real.
    With ``release``, each row's list is emptied layer by layer as it is copied, so the rows and the
    new cache are never both held whole: stacking the 16 kept prefixes of a demo step's next turn
    (~0.4 GB) otherwise held both, and the copy made to append the turn's tokens, for a moment.
    """
    cache = new_cache(model)
    width = max(row[0][0].shape[2] for row in rows)
    for index, layer in enumerate(cache.layers):
        parts = [row.pop(0) if release else row[index] for row in rows]
        keys = _stacked([part[0] for part in parts], width, room)
        values = _stacked([part[1] for part in parts], width, room)
        del parts  # with release, the rows' copies of this layer go now
        # Not the public cache.update(): it copies them once more, 2.3x the CPU time of this
        # (docs/benchmarks.md, "The transformers range").
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache
