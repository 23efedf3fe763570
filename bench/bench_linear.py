"""float32 linears on this CPU: F.linear (MKL on x86) against oneDNN, per shape and in a training step.

    python bench/bench_linear.py            # every weight shape of the embedded model, then a step
    python bench/bench_linear.py --quick    # fewer row counts, a shorter step

1. Per shape: each weight shape of the embedded model at a decode step's rows (16) and at training
   row counts, the forward, the input gradient (``grad @ W``) and the weight gradient
   (``grad^T @ x``), each through ``F.linear``/``@`` and through oneDNN (what
   ``cookbook_lib/runtime/onednn_linear.py`` calls): best-of times and the ratio oneDNN / MKL.
2. A training forward and backward of the embedded model with activation checkpointing, as the
   trainer runs it (``enable_activation_checkpointing``: checkpoint's ``context_fn`` recomputes
   under the same mode), plain and inside ``OneDnnLinears``, alternating: seconds, the ratio, the
   two losses and the relative difference of a weight's gradient (float32 rounding: ~1e-5).
3. What the cached probe says (``onednn_linear.onednn_linear_speedup``) and so whether a run uses it.

Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cookbook_lib.grpo.trainer import enable_activation_checkpointing
from cookbook_lib.runtime import cpu_probe
from cookbook_lib.runtime.memory import large_blocks_mapped, release_memory
from cookbook_lib.runtime.models import load_model
from cookbook_lib.runtime.onednn_linear import (
    MIN_SPEEDUP,
    OneDnnLinears,
    onednn_linear_forward,
    onednn_linear_speedup,
)


def best_ms(work: Callable[[], object], repeats: int = 3, calls: int = 5) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            work()
        best = min(best, (time.perf_counter() - started) / calls)
    return 1000 * best


def linear_pairs(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> list[tuple[Callable, ...]]:
    """(MKL, oneDNN) for the forward, the input gradient and the weight gradient of one linear."""
    return [
        (lambda: F.linear(x, weight), lambda: onednn_linear_forward(x, weight, None)),
        (lambda: grad @ weight, lambda: onednn_linear_forward(grad, weight.t(), None)),
        (lambda: grad.t() @ x, lambda: onednn_linear_forward(grad.t(), x.t(), None)),
    ]


def shape_table(model, row_counts: list[int]) -> None:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print("| rows | weight [out, in] | forward MKL / oneDNN ms | input grad | weight grad |")
    print("| ---: | --- | --- | --- | --- |")
    for rows in row_counts:
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features)
            x, grad = torch.randn(rows, in_features), torch.randn(rows, out_features)
            pairs = linear_pairs(x, weight, grad)
            if rows > 16 and out_features > 10_000:
                pairs = pairs[:1]  # the LM head trains on 128-row chunks; its big products are slow here
            cells = []
            with torch.inference_mode():
                for mkl, onednn in pairs:
                    a, b = best_ms(mkl), best_ms(onednn)
                    cells.append(f"{a:.2f} / {b:.2f} (**{b / a:.2f}x**)")
            cells += [""] * (3 - len(cells))
            print(f"| {rows} | [{out_features}, {in_features}] | " + " | ".join(cells) + " |")


def training_step(model, ids: torch.Tensor, context: Callable) -> tuple[float, float, torch.Tensor]:
    """Seconds, loss and one weight's gradient of a checkpointed forward and backward."""
    started = time.perf_counter()
    with large_blocks_mapped(), context():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    seconds = time.perf_counter() - started
    gradient = model.model.layers[3].mlp.down_proj.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    release_memory()
    return seconds, loss.item(), gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="rows 16 and 1024; a 2 x 256 step, one round")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model()
    print(f"{cpu_probe.cpu_model_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    shape_table(model, [16, 1024] if args.quick else [16, 128, 1024, 4096])

    enable_activation_checkpointing(model)
    model.train()
    ids = torch.randint(100, model.config.vocab_size - 100, (2, 256 if args.quick else 520))
    arms = {"MKL (F.linear)": contextlib.nullcontext, "oneDNN (OneDnnLinears)": OneDnnLinears}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for context in arms.values():
        training_step(model, ids, context)  # warm-up
    for _ in range(1 if args.quick else 3):
        results = {}
        for name, context in arms.items():
            took, loss, gradient = training_step(model, ids, context)
            seconds[name].append(took)
            results[name] = (loss, gradient)
        (loss_a, grad_a), (loss_b, grad_b) = results.values()
        drift = float((grad_a - grad_b).norm() / grad_a.norm())
        timings = " | ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items())
        print(
            f"  step {ids.shape[0]}x{ids.shape[1]}: {timings} | losses {loss_a:.6f} {loss_b:.6f}"
            f" | gradient rel. diff {drift:.1e}"
        )
    mkl, onednn = (min(s) for s in seconds.values())
    print(f"training forward+backward: {mkl:.2f} s -> {onednn:.2f} s: **{onednn / mkl:.2f}x**")
    speedup = onednn_linear_speedup()
    print(f"the cached probe: oneDNN {speedup:.2f}x MKL's rate; runs use oneDNN: {speedup >= MIN_SPEEDUP}")


if __name__ == "__main__":
    main()
