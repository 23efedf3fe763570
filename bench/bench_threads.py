"""Where CPU work runs: the main thread against a worker thread, side by side in one run.

    python bench/bench_threads.py                       # torch's defaults
    OMP_WAIT_POLICY=PASSIVE python bench/bench_threads.py

Each thread that runs torch ops owns an OpenMP team, and libgomp stops spin-waiting between
parallel regions once it manages more threads than there are CPUs. The generator decodes on a
worker thread while the trainer runs on the event loop's, so this times one decode step of 16 rows
of the embedded model (a ~400-token cache, median of ``--steps``) on the main thread, then on a
worker thread while the main thread's team exists, and prints the ratio.

Then the warm-start's case: training steps (forward and backward of ``--train-rows`` x 512 tokens)
in :func:`run_in_own_thread` while the caller only waits, its team kept against let go (what
``run_in_own_thread`` does), alternating for ``--rounds``; it prints wall, user and system seconds
and voluntary context switches of each, and the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import threading
import time
from unittest import mock

import torch
from transformers import DynamicCache

from cookbook_lib.generators.kv_cache import cache_keyword
from cookbook_lib.runtime import own_thread
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


def train_steps(model, batch_BT: torch.Tensor, steps: int) -> None:
    """``steps`` forward and backward passes of a causal LM loss over ``batch_BT`` (no optimizer)."""
    for _ in range(steps):
        model(input_ids=batch_BT, labels=batch_BT).loss.backward()
        model.zero_grad(set_to_none=True)


def train_in_own_thread(model, batch_BT: torch.Tensor, steps: int, let_go: bool) -> list[float]:
    """Wall, user and system seconds and the process's voluntary context switches (a helper that
    sleeps on a futex instead of spinning makes one) of :func:`train_steps` in ``run_in_own_thread``,
    the calling thread's team (built by a matmul just before, as a model's loading builds it) kept or
    let go."""
    torch.randn(512, 512) @ torch.randn(512, 512)
    # Kept: run_in_own_thread as it was before it let go of its caller's team.
    kept = mock.patch.object(own_thread, "release_openmp_team", lambda: False)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with contextlib.nullcontext() if let_go else kept:
        own_thread.run_in_own_thread(lambda stop: train_steps(model, batch_BT, steps), name="train")
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    return [
        wall,
        after.ru_utime - before.ru_utime,
        after.ru_stime - before.ru_stime,
        after.ru_nvcsw - before.ru_nvcsw,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--train-rows", type=int, default=4)
    parser.add_argument("--train-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
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

    model.train()
    batch_BT = torch.randint(100, 20000, (args.train_rows, 512))
    totals = {False: [0.0] * 4, True: [0.0] * 4}
    for _ in range(args.rounds):
        for let_go in (False, True):
            figures = train_in_own_thread(model, batch_BT, args.train_steps, let_go)
            totals[let_go] = [total + figure for total, figure in zip(totals[let_go], figures, strict=True)]
    print(
        f"{args.train_steps} training steps of {args.train_rows} x 512 tokens in run_in_own_thread, "
        f"{args.rounds} rounds:"
    )
    for let_go, label in ((False, "caller's team kept"), (True, "caller's team let go")):
        wall, user, system, switches = totals[let_go]
        print(
            f"  {label:22s} wall {wall:6.1f} s | user {user:6.1f} s | "
            f"system {system:5.1f} s ({system / user:.1%} of user) | {switches:,.0f} context switches"
        )
    kept, released = totals[False], totals[True]
    print(
        f"  let go / kept: wall {released[0] / kept[0]:.2f}x, "
        f"system {released[2] / max(kept[2], 1e-9):.2f}x, "
        f"context switches {released[3] / max(kept[3], 1):.2f}x"
    )


if __name__ == "__main__":
    main()
