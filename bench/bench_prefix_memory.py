"""Resident memory of the prefill that resumes kept prefixes: the old stacking against the new, side by side.

    python bench/bench_prefix_memory.py                # the demo's shape: 16 rows, 520 kept tokens, 40 new
    python bench/bench_prefix_memory.py --rows 4 --kept 200 --fed 20   # a quick run

When the episodes of a step take their next turn, the generator stacks their kept prefixes (the KV
caches of their previous turns) into one batch cache and feeds the turn's new tokens. Arms, each in
a fresh process on the embedded model (float32), with random keys and values of the real shapes:
  old  what the generator did before session 17: the stack built with no spare columns while the
       kept prefixes stay alive until the prefill returns, so the forward copies every layer to
       append the new tokens (``stack_rows(..., room=0, release=False)``);
  new  the stack built with room for the new tokens, each kept prefix's layer let go once copied
       (``stack_rows(..., room=fed, release=True)``, what ``PrefillBatch.admit`` does now);
  mapped  new, with each kept prefix copied under ``large_blocks_mapped`` (its own mapping, handed
       back to the system the moment the stack lets it go, where an arena would keep it resident).
       Not what the library does: measured as the next lead for the demo's peak.
A thread samples VmRSS every 2 ms; the figure is the peak over the stack and the forward, less
the resident size before them (after ``release_memory``), with the kept prefixes' own size beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

ARMS = ("old", "new", "mapped")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_arm(arm: str, rows: int, kept: int, fed: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from cookbook_lib.generators import kv_cache
    from cookbook_lib.runtime.memory import large_blocks_mapped, release_memory
    from cookbook_lib.runtime.models import resolve_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(), dtype=torch.float32).eval()
    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Prefixes of different lengths, as the episodes of a step have after their first turn.
    lengths = [kept - 7 * (i % 4) for i in range(rows)]
    # The generator copies a finished row's keys and values out on its own thread, from its arena;
    # the "mapped" arm gives each copy its own mapping instead (the lead this bench measures).
    with large_blocks_mapped() if arm == "mapped" else contextlib.nullcontext():
        prefixes = [
            [
                (torch.randn(1, heads, length, head_dim), torch.randn(1, heads, length, head_dim))
                for _ in range(config.num_hidden_layers)
            ]
            for length in lengths
        ]
    prefix_bytes = sum(k.nbytes + v.nbytes for layers in prefixes for k, v in layers)
    width = max(lengths)
    mask_BL = torch.zeros(rows, width + fed, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask_BL[i, width - length :] = 1
    positions_BL = (mask_BL.cumsum(dim=1) - 1)[:, width:]
    ids_BL = torch.randint(0, config.vocab_size, (rows, fed))
    keyword = kv_cache.cache_keyword(model)

    def prefill(cache) -> None:
        model(input_ids=ids_BL, attention_mask=mask_BL, position_ids=positions_BL, use_cache=True,
              logits_to_keep=1, **{keyword: cache})  # fmt: skip

    with (
        torch.inference_mode()
    ):  # a first forward of these shapes: its one-time allocations are not the arm's
        prefill(
            kv_cache.stack_rows(model, [[(k.clone(), v.clone()) for k, v in layers] for layers in prefixes])
        )
    release_memory()
    before, peak, stop = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    with torch.inference_mode():
        if arm == "old":
            cache = kv_cache.stack_rows(model, prefixes)
        else:
            cache = kv_cache.stack_rows(model, prefixes, room=fed, release=True)
        prefill(cache)
        del prefixes  # the old path held them until the prefill returned
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    after = resident_bytes()
    cache_bytes = sum(layer.keys.untyped_storage().nbytes() * 2 for layer in cache.layers)
    return dict(arm=arm, peak_above=max(peak[0], after) - before, after_above=after - before,
                prefix_bytes=prefix_bytes, cache_bytes=cache_bytes, seconds=seconds)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--kept", type=int, default=520, help="tokens of the longest kept prefix")
    parser.add_argument("--fed", type=int, default=40, help="new tokens each row feeds")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in this process
    args = parser.parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.rows, args.kept, args.fed)))
        return
    print(f"{args.rows} rows resuming kept prefixes of up to {args.kept} tokens, {args.fed} new tokens each:")
    results = {}
    for arm in ARMS:  # each in a fresh process: one arm's freed memory cannot serve the other's
        command = [sys.executable, __file__, f"--arm={arm}", f"--rows={args.rows}", f"--kept={args.kept}",
                   f"--fed={args.fed}"]  # fmt: skip
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[arm] = result = json.loads(output.strip().splitlines()[-1])
        megabytes = {key: value / 1e6 for key, value in result.items() if key.endswith(("_above", "_bytes"))}
        print(f"  {arm}: peak {megabytes['peak_above']:.0f} MB above the start, "
              f"{megabytes['after_above']:.0f} MB after; kept prefixes {megabytes['prefix_bytes']:.0f} MB, "
              f"the batch cache {megabytes['cache_bytes']:.0f} MB; {result['seconds']:.2f} s")  # fmt: skip
    for arm in ARMS[1:]:
        ratio = results[arm]["peak_above"] / results["old"]["peak_above"]
        print(f"peak above the start, {arm} / old: {ratio:.2f}x")


if __name__ == "__main__":
    main()
