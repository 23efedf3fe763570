"""The demo in float32 against bfloat16 over several seeds: does bf16 learn as well, and how much faster?

    python bench/bench_precision.py                    # seeds 0 1 2, both dtypes each (~70 min, 2 cores)
    python bench/bench_precision.py --seeds 0 --steps 3
    python bench/bench_precision.py --report-only      # print what finished runs measured

``dtype="auto"`` picks bf16 on a CPU whose bf16 matmuls measure several times faster
(``runtime/devices.py``); bf16 costs exact importance ratios (the sampler's and the trainer's
log-probs of a token differ by rounding), so it became the default only once the demo learned as
well in bf16 as in float32 over several seeds. This bench is that comparison: each seed runs the
README's main job (``python -m recipes.demo --seed S --dtype D``) in a fresh process per dtype, the
two alternating, into ``runs/bench-precision-<dtype>-s<seed>/``. A finished run is not run again:
its figures (``bench_precision.json`` beside its metrics: wall, CPU times, peak RSS) are read back.

Printed per run and as each dtype's mean over the seeds: validation reward after the warm-start,
at the middle and at the end, the mean training reward of the steps, the mean importance ratio's
range and the clipped fraction, the seconds spent sampling and training, the wall time, system
time over user time, and the peak RSS; then bf16 over float32 for the times. The learning figures
come from ``metrics.jsonl``; the resources from ``wait4`` on each run's process. Timings on a
shared CPU are noisy: read the ratio of one run, with ``uptime`` low before it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
FIGURES = "bench_precision.json"
RUNS = ROOT / "runs"  # where the demo writes its runs (GRPOConfig.runs_dir's default, from the repo root)


def run_name(dtype: str, seed: int) -> str:
    return f"bench-precision-{dtype}-s{seed}"


def run_demo(dtype: str, seed: int, runs_dir: Path, extra: list[str]) -> dict[str, float]:
    """One demo in a fresh process; its wall time, CPU times and peak RSS (kept beside its metrics)."""
    name = run_name(dtype, seed)
    figures_path = runs_dir / name / FIGURES
    if figures_path.exists():
        return json.loads(figures_path.read_text())
    command = [
        sys.executable,
        "-m",
        "recipes.demo",
        "--run-name",
        name,
        "--seed",
        str(seed),
        "--dtype",
        dtype,
    ]
    print(f"==> {' '.join(command[1:] + extra)}", flush=True)
    started = time.perf_counter()
    process = subprocess.Popen(command + extra, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{name} failed with exit code {process.returncode}")
    figures = {
        "wall_s": time.perf_counter() - started,
        "user_s": usage.ru_utime,
        "system_s": usage.ru_stime,
        "peak_rss_gb": usage.ru_maxrss / 1e6,  # kilobytes on Linux
        "minor_faults": float(usage.ru_minflt),
    }
    figures_path.write_text(json.dumps(figures, indent=1))
    return figures


def learning_figures(metrics_path: Path) -> dict[str, object]:
    """What a run's ``metrics.jsonl`` says about how it learned and where its time went."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [row for row in rows if row["step"] > 0 and "reward_mean" in row]
    validation = [row["val/reward_mean"] for row in rows if "val/reward_mean" in row]
    ratios = [row["train/ratio_mean"] for row in steps if "train/ratio_mean" in row]
    sampled = sum(row.get("sampled_tokens", 0.0) for row in steps)
    sampling_s = sum(row.get("time/sampling_s", 0.0) for row in steps)
    return {
        "validation": validation,
        "train_reward_mean": statistics.mean(row["reward_mean"] for row in steps),
        "ratio_min": min(ratios, default=float("nan")),
        "ratio_max": max(ratios, default=float("nan")),
        "clip_frac_mean": statistics.mean(row.get("train/clip_frac", 0.0) for row in steps),
        "sampling_s": sampling_s,
        "training_s": sum(row.get("time/training_s", 0.0) for row in steps),
        "sampled_tok_per_s": sampled / sampling_s if sampling_s else float("nan"),
    }


def report(results: dict[tuple[str, int], dict], seeds: list[int]) -> None:
    header = (
        f"{'dtype':>9} {'seed':>4} | {'validation':>20} | {'train rew':>9} | {'ratio range':>15} | "
        f"{'clip':>6} | {'sampling s':>10} {'tok/s':>6} | {'training s':>10} | {'wall s':>7} | "
        f"{'sys/user':>8} | {'peak GB':>7}"
    )
    print(header)
    print("-" * len(header))
    for dtype in DTYPES:
        for seed in seeds:
            r = results.get((dtype, seed))
            if r is None:
                continue
            validation = " -> ".join(f"{v:.2f}" for v in r["validation"])
            print(
                f"{dtype:>9} {seed:>4} | {validation:>20} | {r['train_reward_mean']:9.3f} | "
                f"{r['ratio_min']:.4f}-{r['ratio_max']:.4f} | {r['clip_frac_mean']:6.4f} | "
                f"{r['sampling_s']:10.1f} {r['sampled_tok_per_s']:6.1f} | {r['training_s']:10.1f} | "
                f"{r['wall_s']:7.0f} | {r['system_s'] / r['user_s']:8.1%} | {r['peak_rss_gb']:7.2f}"
            )
    means: dict[str, dict[str, float]] = {}
    for dtype in DTYPES:
        runs = [results[(dtype, seed)] for seed in seeds if (dtype, seed) in results]
        if not runs:
            continue
        means[dtype] = {
            "val_first": statistics.mean(r["validation"][0] for r in runs),
            "val_last": statistics.mean(r["validation"][-1] for r in runs),
            "val_gain": statistics.mean(r["validation"][-1] - r["validation"][0] for r in runs),
            "train_reward_mean": statistics.mean(r["train_reward_mean"] for r in runs),
            **{key: statistics.mean(r[key] for r in runs) for key in ("sampling_s", "training_s", "wall_s")},
            "peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
            "runs": len(runs),
        }
        m = means[dtype]
        print(
            f"{dtype:>9} mean of {m['runs']}: validation {m['val_first']:.3f} -> {m['val_last']:.3f} "
            f"(gain {m['val_gain']:+.3f}), train reward {m['train_reward_mean']:.3f}, sampling "
            f"{m['sampling_s']:.0f} s, training {m['training_s']:.0f} s, wall {m['wall_s']:.0f} s, "
            f"peak {m['peak_rss_gb']:.2f} GB"
        )
    if len(means) == 2:
        fp32, bf16 = means["float32"], means["bfloat16"]
        print(
            "bfloat16 / float32: "
            + ", ".join(
                f"{key} {bf16[key] / fp32[key]:.2f}x" for key in ("sampling_s", "training_s", "wall_s")
            )
            + f"; final validation {bf16['val_last'] - fp32['val_last']:+.3f}, "
            f"train reward {bf16['train_reward_mean'] - fp32['train_reward_mean']:+.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the demo's)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; report finished runs")
    args = parser.parse_args()
    extra = ["--steps", str(args.steps)] if args.steps is not None else []
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        for dtype in DTYPES:
            run_dir = RUNS / run_name(dtype, seed)
            if args.report_only and not (run_dir / FIGURES).exists():
                continue
            figures = run_demo(dtype, seed, RUNS, extra)
            results[(dtype, seed)] = {**figures, **learning_figures(run_dir / "metrics.jsonl")}
    report(results, args.seeds)


if __name__ == "__main__":
    main()
