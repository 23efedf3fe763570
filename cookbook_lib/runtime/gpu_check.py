"""One command that shows whether the cookbook runs, and how fast, on this machine's GPU.

    python -m cookbook_lib.gpu_check                 # on a GPU machine (about 5 minutes)
    python -m cookbook_lib.gpu_check --device cpu    # try it before a GPU is at hand (random-init model)
    python -m cookbook_lib.gpu_check --out runs/gpu_check

It runs, each as its own process with a time limit, from the repository checkout:

1. the GPU tests (``tests/gpu``, which skip without CUDA) and the precision tests;
2. the demo recipe (``recipes.grpo.tool_use_game``) for a few steps on the device: warm-start,
   lockstep GRPO, validation before and after;
3. ``bench/bench_gpu.py``: decoding throughput and one GRPO step, fp32 against bf16.

Then it prints one summary (also written to ``<out>/summary.txt``, with every log beside it).
On a CPU the demo and the bench use a random-init model of the embedded architecture and tiny
sizes, so the whole check takes a few minutes and only shows that every path runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 8 * 60


@dataclass
class Phase:
    name: str
    command: list[str]
    timeout_s: float
    returncode: int | None = None
    seconds: float = 0.0
    tail: str = ""

    @property
    def status(self) -> str:
        if self.returncode is None:
            return f"TIMED OUT after {self.timeout_s:.0f} s"
        return "ok" if self.returncode == 0 else f"FAILED (exit {self.returncode})"


def run_phase(phase: Phase, log: Path, cwd: Path) -> Phase:
    """Run one phase, its output into ``log``; a phase that fails or hangs never stops the others."""
    print(f"==> {phase.name}: {' '.join(phase.command)}", flush=True)
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            done = subprocess.run(
                phase.command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=phase.timeout_s
            )
            phase.returncode = done.returncode
        except subprocess.TimeoutExpired:
            phase.returncode = None
    phase.seconds = time.perf_counter() - start
    phase.tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    print(f"    {phase.status} in {phase.seconds:.0f} s (log: {log})", flush=True)
    return phase


def pytest_counts(text: str) -> str:
    """pytest's closing line ("3 passed, 2 skipped in 4.1s"), or what is left of it."""
    for line in reversed(text.splitlines()):
        if " in " in line and any(word in line for word in ("passed", "failed", "skipped", "error")):
            return line.strip("= ")
    return "no pytest summary found"


def demo_summary(run_dir: Path) -> str:
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        return "no metrics written"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rewards = [(m["step"], m["val/reward_mean"]) for m in metrics if "val/reward_mean" in m]
    steps = [m["time/step_s"] for m in metrics if "time/step_s" in m]
    parts = [f"{max(len(metrics) - 1, 0)} GRPO steps"]
    if len(rewards) >= 2:
        parts.append(f"validation reward {rewards[0][1]:.2f} (step {rewards[0][0]}) -> {rewards[-1][1]:.2f}")
    if steps:
        parts.append(f"mean step {sum(steps) / len(steps):.1f} s")
    return ", ".join(parts)


def machine_line(device: str) -> str:
    import torch
    import transformers

    if device != "cpu" and torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        where = f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    versions = f"python {platform.python_version()}, torch {torch.__version__}"
    return f"{where}; {versions}, transformers {transformers.__version__}"


def _save_tiny_model(folder: Path) -> Path:
    from cookbook_lib.runtime.models import tiny_random_model
    from cookbook_lib.runtime.quiet import quiet_libraries

    model, tokenizer = tiny_random_model(seed=0, embedding_scale=10.0)
    with quiet_libraries():
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default=None, help="folder for logs and the summary (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps of the demo")
    args = parser.parse_args(argv)

    import torch

    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if on_gpu else "cpu")
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    started = time.perf_counter()
    print(f"GPU check on {machine_line(device)}; logs in {out}", flush=True)

    demo_args = ["--device", device, "--run-name", "demo"]
    # --profile: kernel launches per decode step in each dtype, the figure behind "why is bf16 slower".
    bench_args = ["--device", device, "--out", str(out / "bench_gpu.json"), "--profile"]
    if on_gpu:
        demo_args += ["--steps", str(args.steps), "--val-tasks", "20"]
    else:
        # A CPU can only show that every path runs: a tiny random-init model (the embedded
        # model's tokenizer, 2 small layers), tiny sizes.
        model_dir = str(_save_tiny_model(out / "tiny-random-model"))
        demo_args += ["--small", "--model", model_dir]
        bench_args += ["--model", model_dir, "--rows", "4", "--new-tokens", "8", "--steps", "2"]

    pytest_command = [
        python,
        "-m",
        "pytest",
        "tests/gpu",
        "tests/test_precision.py",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    # The repo's addopts run notebooks too (--nbmake); this check does not.
    pytest_command += ["-o", "addopts=-ra --strict-markers", "-m", "gpu or not slow"]
    phases = [
        run_phase(Phase("tests", pytest_command, timeout_s=180), out / "tests.log", REPO),
        run_phase(
            Phase("demo", [python, "-m", "recipes.grpo.tool_use_game", *demo_args], timeout_s=180),
            out / "demo.log",
            out,  # the recipe writes runs/demo/ under its working directory
        ),
        run_phase(
            Phase("bench", [python, str(REPO / "bench" / "bench_gpu.py"), *bench_args], timeout_s=240),
            out / "bench.log",
            REPO,
        ),
    ]
    total = time.perf_counter() - started
    tests, demo, bench = phases
    lines = [
        f"GPU check, {time.strftime('%Y-%m-%d %H:%M')}: {machine_line(device)}",
        f"device {device}; total {total:.0f} s (budget {BUDGET_S} s)",
        f"tests: {tests.status}, {pytest_counts(tests.tail)}",
        f"demo: {demo.status} in {demo.seconds:.0f} s, {demo_summary(out / 'runs' / 'demo')}",
        f"bench: {bench.status} in {bench.seconds:.0f} s",
    ]
    report = out / "bench_gpu.json"
    if report.is_file():
        lines += ["  " + line for line in json.loads(report.read_text())["summary"][1:]]
    for phase in phases:
        if phase.returncode != 0:
            lines += [f"--- last lines of {phase.name}:", phase.tail]
    summary = "\n".join(lines)
    (out / "summary.txt").write_text(summary + "\n")
    print("\n" + summary)
    return 0 if all(phase.returncode == 0 for phase in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
