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
    spare ones, and only a step that finds no room copies, into a buffer with ``1/SLACK_FRACTION``
    spare columns (at least ``MIN_SLACK_COLUMNS``) after them, and as many before them for wider
    rows a merge adds: a copy every ~L/8 steps, for at most ~1/4 more cache memory.

    The keys are a view of the buffer (``buffer[:rows, :, start:start + columns]``), so everything
    that reads them (attention, the row and column surgery below) sees exactly the tensors it saw
    before. ``merge`` and ``stack_rows`` build such buffers too, and the surgery keeps them: removing
    rows moves the kept ones up within the buffer, dropping leading columns narrows the view, and a
    merge writes new rows into rows and columns freed so. A tensor of another layout (a gather that
    repeats rows) simply has no spare columns, and the next update copies it into a new buffer.
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


def _geometry(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """``(capacity, start, buffer_rows)`` when ``tensor`` is the columns ``start:start + columns`` of
    the leading rows of a ``[buffer_rows, heads, capacity, head_dim]`` buffer, else None.

    Every buffer this module makes has that layout; a view of one that drops leading columns
    (``drop_leading_columns``) or trailing rows (``select_rows``) keeps it, with the columns after
    its last one and the rows after its last one free for the next writes.
    """
    rows, heads, columns, head_dim = tensor.shape
    if head_dim == 0 or heads == 0:
        return None
    capacity = tensor.stride(1) // head_dim
    start, misaligned = divmod(tensor.storage_offset(), head_dim)
    layout = (heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
    if misaligned or tensor.stride() != layout or start + columns > capacity:
        return None
    buffer_rows = tensor.untyped_storage().nbytes() // (heads * capacity * head_dim * tensor.element_size())
    return (capacity, start, buffer_rows) if buffer_rows >= rows else None


def _spare_columns(tensor: torch.Tensor) -> int:
    """How many columns past ``tensor``'s last one its buffer holds for it (0 unless it is a view of
    one of this module's buffers, see ``_geometry``)."""
    geometry = _geometry(tensor)
    return 0 if geometry is None else geometry[0] - geometry[1] - tensor.shape[2]


def _widened(tensor: torch.Tensor, rows: int, columns: int, start: int) -> torch.Tensor:
    """The view of ``tensor``'s buffer with ``rows`` leading rows and ``columns`` columns from
    column ``start`` (the caller checked with ``_geometry`` that the buffer holds them)."""
    _, heads, _, head_dim = tensor.shape
    return tensor.as_strided((rows, heads, columns, head_dim), tensor.stride(), start * head_dim)


def _slack(columns: int) -> int:
    """Spare columns for a buffer of ``columns`` columns, on each side of them."""
    return max(MIN_SLACK_COLUMNS, columns // SLACK_FRACTION)


def _new_view(
    like: torch.Tensor, rows: int, columns: int, room: int = 0, buffer_rows: int = 0
) -> torch.Tensor:
    """``rows`` x ``columns`` columns (not yet written) of a new buffer with slack on both sides:
    ``room`` plus ``_slack`` columns after them for the next writes, ``_slack`` columns before them
    for wider rows a merge adds, and ``buffer_rows`` rows if that is more than ``rows``."""
    lead = _slack(columns)
    capacity = lead + columns + room + _slack(columns + room)
    buffer = like.new_empty((max(rows, buffer_rows), like.shape[1], capacity, like.shape[3]))
    return buffer[:rows, :, lead : lead + columns]


def _with_room(states: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """A new buffer holding ``kept`` then ``states`` along the columns, with slack around them (and
    as many rows as ``kept``'s buffer had, for rows a merge adds)."""
    old = 0 if kept is None else kept.shape[2]
    geometry = None if kept is None else _geometry(kept)
    buffer_rows = geometry[2] if geometry is not None else 0
    view = _new_view(states, states.shape[0], old + states.shape[2], buffer_rows=buffer_rows)
    if kept is not None:
        view[:, :, :old].copy_(kept)
    view[:, :, old:].copy_(states)
    return view


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
    """Keep only ``rows`` (indices into the batch dimension), in that order.

    Where no row moves down (``rows[j] >= j``, no repeats: rows removed, see
    :func:`order_after_removing`), plain layers move the kept rows up within their buffers and keep
    the leading rows as a view: nothing is allocated, the freed rows stay in the buffer for rows a
    later ``merge`` adds, and the spare columns stay for the next decode steps. A gather (new
    tensors) copied the whole cache at every removal, and the next step copied it again to find
    room: on the demo, most of sampling's page faults (docs/benchmarks.md, session 26).
    """
    order = rows.tolist()
    moves_up = len(set(order)) == len(order) and all(source >= row for row, source in enumerate(order))
    if not (moves_up and supports_merging(cache)):
        cache.batch_select_indices(rows)
        return
    # In-place writes into tensors a forward made under inference mode must happen under it too.
    with torch.inference_mode(cache.layers[0].keys.is_inference()):
        for layer in cache.layers:
            layer.keys = _rows_moved_up(layer.keys, order)
            layer.values = _rows_moved_up(layer.values, order)


def order_after_removing(rows: int, removed: list[int]) -> list[int]:
    """The rows kept when ``removed`` go, ordered so that ``select_rows`` moves as few as possible:
    each removed row below the new count takes one of the last rows' place, the others stay."""
    gone = set(removed)
    count = rows - len(gone)
    movers = iter([row for row in range(count, rows) if row not in gone])
    return [next(movers) if row in gone else row for row in range(count)]


def _rows_moved_up(tensor: torch.Tensor, order: list[int]) -> torch.Tensor:
    for row, source in enumerate(order):
        if source != row:
            tensor[row].copy_(tensor[source])
    return tensor[: len(order)]


def _stacked(parts: list[torch.Tensor], width: int, room: int = 0) -> torch.Tensor:
    """``parts`` (each ``[rows_i, kv_heads, columns_i, head_dim]``) one under the other, each
    right-aligned in ``width`` columns (zeros before the shorter ones), in a new buffer with
    ``room`` spare columns after them besides the usual slack (``_new_view``).

    ``torch.cat`` of left-padded parts would build each padded part, then the result, and leave no
    spare columns, so the next forward would copy the whole layer once more: here each part is
    copied once, and a forward of up to ``room`` tokens (a prefill after a kept prefix) or the next
    decode steps write in place.
    """
    view = _new_view(parts[0], sum(part.shape[0] for part in parts), width, room)
    start = 0
    for part in parts:
        rows, padding = part.shape[0], width - part.shape[2]
        view[start : start + rows, :, :padding].zero_()
        view[start : start + rows, :, padding:].copy_(part)
        start += rows
    return view


def merge(first: DynamicCache, second: DynamicCache) -> None:
    """Append the rows of ``second`` after those of ``first`` (in place), right-aligning columns.

    The shorter of the two is left-padded with zero columns; the caller pads its masks the same.
    Where ``first``'s buffers have the rows (freed by ``select_rows``) and the leading columns
    (dropped by ``drop_leading_columns``) for it, ``second`` is written into them; else both are
    copied into new buffers.
    """
    for mine, theirs in zip(first.layers, second.layers, strict=True):
        width = max(mine.keys.shape[2], theirs.keys.shape[2])
        mine.keys = _joined(mine.keys, theirs.keys, width)
        mine.values = _joined(mine.values, theirs.values, width)


def _joined(mine: torch.Tensor, theirs: torch.Tensor, width: int) -> torch.Tensor:
    """``mine``'s rows then ``theirs``, each right-aligned in ``width`` columns: within ``mine``'s
    buffer where it holds them, else in a new one (``_stacked``)."""
    geometry = _geometry(mine)
    rows, wider = mine.shape[0], width - mine.shape[2]
    if geometry is None or mine.shape[1] != theirs.shape[1] or mine.dtype != theirs.dtype:
        return _stacked([mine, theirs], width)
    _, start, buffer_rows = geometry
    if start < wider or rows + theirs.shape[0] > buffer_rows:
        return _stacked([mine, theirs], width)
    joined = _widened(mine, rows + theirs.shape[0], width, start - wider)
    with torch.inference_mode(mine.is_inference()):
        joined[:rows, :, :wider].zero_()
        padding = width - theirs.shape[2]
        joined[rows:, :, :padding].zero_()
        joined[rows:, :, padding:].copy_(theirs)
    return joined


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
