"""Where a CPU decode step runs: the main thread against a worker thread, side by side in one run.

    python bench/bench_threads.py                       # torch's defaults
    OMP_WAIT_POLICY=PASSIVE python bench/bench_threads.py

Each thread that runs torch ops owns an OpenMP team, and libgomp stops spin-waiting between
parallel regions once it manages more threads than there are CPUs. The generator decodes on a
worker thread while the trainer runs on the event loop's, so this times one decode step of 16 rows
of the embedded model (a ~400-token cache, median of ``--steps``) on the main thread, then on a
worker thread while the main thread's team exists, and prints the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
from transformers import DynamicCache

from cookbook_lib.generators.kv_cache import cache_keyword
from cookbook_lib.runtime.models import load_model


def decode_step_ms(model, prompt_BT: torch.Tensor, steps: int) -> float:
    """The median time of one cached decode step over ``steps`` steps, in milliseconds."""
    keyword = cache_keyword(model)  # its name changed in transformers 5.24
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=prompt_BT, use_cache=True, **{keyword: cache})
        token_B1 = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            out = model(input_ids=token_B1, use_cache=True, **{keyword: cache})
            token_B1 = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model().eval()
    prompt_BT = torch.randint(100, 20000, (args.rows, 400))
    print(
        f"{args.rows} rows, torch threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )
    main_ms = decode_step_ms(model, prompt_BT, args.steps)  # the main thread's team now exists
    result: dict[str, float] = {}
    worker = threading.Thread(target=lambda: result.update(ms=decode_step_ms(model, prompt_BT, args.steps)))
    worker.start()
    worker.join()
    print(
        f"main thread {main_ms:.1f} ms | worker thread {result['ms']:.1f} ms | "
        f"worker / main {result['ms'] / main_ms:.2f}x"
    )


if __name__ == "__main__":
    main()
