"""Continuous batching's KV-cache surgery on a CPU: rows moved within their buffers against copied out.

    python bench/bench_kv_surgery.py              # the embedded model's cache shape, 16 rows, 3 rounds
    python bench/bench_kv_surgery.py --quick

In a multi-turn rollout, rows finish a turn one by one and the next turns join the running batch
as their tool calls return. Each finished row is removed from the batch's KV cache, the padding
no row attends to any more is dropped, and each joining row is merged in. Until session 26,
``kv_cache`` did each by copying: a removal gathered every kept row into new tensors
(``Cache.batch_select_indices``), and the next decode step copied the cache again to find spare
columns (a gathered tensor or a trimmed view had none); a merge stacked both caches into new
buffers. Now a removal moves the last rows into the freed places within the buffer, a trim
narrows the view, and a merge writes into rows and leading columns freed so
(``kv_cache.select_rows``, ``merge``).

The bench replays that pattern on a cache shaped like the embedded model's (30 layers, 3 key-value
heads of 64, bf16) without a model: ``--rows`` rows of ~``--columns`` columns, a decode step
appending one column to every layer, a row finishing every ``--finish-every`` steps and a row of
a longer prompt joining a few steps later. The first arm runs ``kv_cache``'s previous surgery
(kept below, as it was), the second the library's; both inside the CPU block cache, as the
generator's steps are, in the same process, alternating. Printed per arm: seconds, minor page
faults, system CPU seconds, and the ratio; and whether the two caches end equal (they must).
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import time
from types import SimpleNamespace

import torch
from transformers import DynamicCache, LlamaConfig

from cookbook_lib.generators import kv_cache
from cookbook_lib.runtime.block_cache import block_cache_active, install_block_cache, release_block_cache


def _old_spare_columns(tensor: torch.Tensor) -> int:
    """Before session 26: room only after a view of a buffer's leading columns."""
    rows, heads, columns, head_dim = tensor.shape
    capacity = tensor.stride(1) // head_dim if head_dim else 0
    layout = (heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
    if tensor.storage_offset() != 0 or tensor.stride() != layout or capacity <= columns:
        return 0
    if tensor.untyped_storage().nbytes() < rows * heads * capacity * head_dim * tensor.element_size():
        return 0
    return capacity - columns


def _old_capacity(columns: int) -> int:
    return columns + max(kv_cache.MIN_SLACK_COLUMNS, columns // kv_cache.SLACK_FRACTION)


def _old_with_room(states: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    old = 0 if kept is None else kept.shape[2]
    columns = old + states.shape[2]
    buffer = states.new_empty((*states.shape[:2], _old_capacity(columns), states.shape[3]))
    if kept is not None:
        buffer[:, :, :old].copy_(kept)
    buffer[:, :, old:columns].copy_(states)
    return buffer[:, :, :columns]


def _old_stacked(parts: list[torch.Tensor], width: int, room: int = 0) -> torch.Tensor:
    first = parts[0]
    rows = sum(part.shape[0] for part in parts)
    buffer = first.new_empty((rows, first.shape[1], _old_capacity(width + room), first.shape[3]))
    start = 0
    for part in parts:
        rows, padding = part.shape[0], width - part.shape[2]
        buffer[start : start + rows, :, :padding].zero_()
        buffer[start : start + rows, :, padding:width].copy_(part)
        start += rows
    return buffer[:, :, :width]


def _old_select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    cache.batch_select_indices(rows)


def _old_merge(first: DynamicCache, second: DynamicCache) -> None:
    for mine, theirs in zip(first.layers, second.layers, strict=True):
        width = max(mine.keys.shape[2], theirs.keys.shape[2])
        mine.keys = _old_stacked([mine.keys, theirs.keys], width)
        mine.values = _old_stacked([mine.values, theirs.values], width)


PREVIOUS = {
    "_spare_columns": _old_spare_columns,
    "_with_room": _old_with_room,
    "_stacked": _old_stacked,
    "select_rows": _old_select_rows,
    "merge": _old_merge,
}


@contextlib.contextmanager
def previous_surgery():
    """``kv_cache`` as it was before session 26, for the duration."""
    saved = {name: getattr(kv_cache, name) for name in PREVIOUS}
    for name, function in PREVIOUS.items():
        setattr(kv_cache, name, function)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(kv_cache, name, function)


def filled_cache(model, rows: int, columns: int, generator: torch.Generator) -> DynamicCache:
    """A cache of ``rows`` rows and ``columns`` columns of random keys and values, as a prefill leaves it."""
    cache = kv_cache.new_cache(model)
    config = model.config
    shape = (rows, config.num_key_value_heads, columns, config.head_dim)
    for layer in cache.layers:
        layer.update(*(torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(2)))
    return cache


class Pattern:
    """Everything random in a round, drawn before it is timed: the decode steps' new columns (one
    per episode), which episode finishes when, and the caches of the rows that join."""

    def __init__(self, model, args, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        config = model.config
        self.args = args
        self.seed = seed
        joins = args.steps // args.finish_every + 1
        episodes = args.rows + joins
        shape = (args.steps, episodes, config.num_key_value_heads, 1, config.head_dim)
        self.columns = [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(2)]
        self.picks = torch.randint(1 << 30, (args.steps,), generator=generator).tolist()
        self.joining = [
            filled_cache(model, 1, args.columns + args.steps // 2 + int(offset), generator)
            for offset in torch.randint(-40, 40, (joins,), generator=generator)
        ]


def replay(model, pattern: Pattern, old: bool) -> tuple[DynamicCache, list[int], list[int], tuple]:
    """One round of the pattern; returns the final cache, its rows' episode ids and real lengths,
    and the round's seconds, minor page faults and system CPU seconds.

    The new columns are drawn per episode, not per row position, so both arms build the same
    episodes although they order their rows differently."""
    args = pattern.args
    cache = filled_cache(model, args.rows, args.columns, torch.Generator().manual_seed(pattern.seed))
    ids, lengths = list(range(args.rows)), [args.columns] * args.rows
    waiting, joined = 0, 0
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for step in range(args.steps):
        index = torch.tensor(ids)
        keys, values = (table[step, index] for table in pattern.columns)
        for layer in cache.layers:
            layer.update(keys, values)
        lengths = [n + 1 for n in lengths]
        if step % args.finish_every == args.finish_every - 1 and len(ids) > 1:
            gone = ids.index(sorted(ids)[pattern.picks[step] % len(ids)])
            if old:
                keep = [r for r in range(len(ids)) if r != gone]
            else:
                keep = kv_cache.order_after_removing(len(ids), [gone])
            kv_cache.select_rows(cache, torch.tensor(keep))
            ids, lengths = [ids[r] for r in keep], [lengths[r] for r in keep]
            unused = cache.layers[0].keys.shape[2] - max(lengths)
            if unused > 0:
                kv_cache.drop_leading_columns(cache, unused)
            waiting += 1
        if waiting and step % args.finish_every == args.finish_every // 2:
            joining = pattern.joining[joined]
            kv_cache.merge(cache, joining)
            ids, lengths = [*ids, args.rows + joined], [*lengths, joining.layers[0].keys.shape[2]]
            waiting, joined = waiting - 1, joined + 1
    seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    faults, system = after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime
    return cache, ids, lengths, (seconds, faults, system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--columns", type=int, default=450)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--finish-every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 rows, 48 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps, args.rounds = 8, 48, 1
    config = LlamaConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    model = SimpleNamespace(config=config)
    installed = install_block_cache()
    print(
        f"{args.rows} rows x ~{args.columns} columns, 30 layers x 3 heads x 64 (bf16), {args.steps} steps, "
        f"a row finishing every {args.finish_every}; block cache {'on' if installed else 'unavailable'}"
    )
    arms = {"copied out (before)": True, "moved in place (now)": False}
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in arms}
    finals = {}
    with torch.inference_mode():
        for round_index in range(args.rounds):
            pattern = Pattern(model, args, seed=round_index)
            for name, old in arms.items():
                release_block_cache()
                with block_cache_active(), previous_surgery() if old else contextlib.nullcontext():
                    *finals[name], measured = replay(model, pattern, old=old)
                results[name].append(measured)
    before, now = (_rows_by_episode(*finals[name]) for name in arms)
    same = before.keys() == now.keys() and all(
        torch.equal(a, b) for episode in before for a, b in zip(before[episode], now[episode], strict=True)
    )
    base = None
    for name, rounds in results.items():
        seconds, faults, system = (statistics.median(r[i] for r in rounds) for i in range(3))
        base = base or (seconds, faults, system)
        print(
            f"{name:>22}: {seconds:6.3f} s ({seconds / base[0]:.2f}x), {faults:8.0f} faults "
            f"({faults / max(base[1], 1):.2f}x), system {system:5.2f} s"
        )
    print(f"the two caches hold the same rows: {same}")


def _rows_by_episode(
    cache: DynamicCache, ids: list[int], lengths: list[int]
) -> dict[int, list[torch.Tensor]]:
    """Each episode's real keys and values, every layer (the arms order their rows differently)."""
    return {
        episode: [
            torch.cat([layer.keys[row, :, -length:], layer.values[row, :, -length:]])
            for layer in cache.layers
        ]
        for row, (episode, length) in enumerate(zip(ids, lengths, strict=True))
    }


if __name__ == "__main__":
    main()
