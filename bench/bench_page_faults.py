"""A training step's page faults and system time, per allocation setting, each in a fresh process.

    python bench/bench_page_faults.py                 # sample one demo step first (--quick warm-start)
    python bench/bench_page_faults.py --episodes runs/RUN/episodes/step_000001.jsonl \
        --model runs/RUN/warm_start_model --rounds 3

A training step frees and allocates gigabytes; within a step, blocks of 256 KB or more get their
own mapping (``runtime.memory.large_blocks_mapped``), so each is faulted in page by page again
when allocated: the demo spent 12-15% of its user time in the kernel. The settings compared:

- the baseline: 4 KB pages, blocks of 256 KB or more mapped within a step (the library until
  session 13), the block cache off (every arm sets the variables it does not name to ``0``).
- ``block cache N MB``: ``runtime.block_cache``, torch's CPU allocator that keeps up to N MB of
  freed large blocks mapped for the next allocation that fits (512 MB is the library's default).
- ``THP``: ``THP_MEM_ALLOC_ENABLE=1``, torch's own switch: CPU tensors of 2 MB or more
  are 2 MB-aligned and advised ``MADV_HUGEPAGE``, one fault per 2 MB where the kernel's
  transparent huge pages are ``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage``).
- ``map >= N``: glibc's mmap threshold within a step (``memory.step_mmap_threshold``): smaller
  blocks are reused from the arenas, larger ones get their own mapping, freed at once.
- ``keep 1 GB``: glibc's trim threshold within a step (free memory kept at a heap's top).

``THP, map >= 32 MB`` is what the library does where the user sets ``THP_MEM_ALLOC_ENABLE=1``
(``runtime.huge_pages``); ``block cache 512 MB`` is its default.

torch reads the variable once, at its first allocation, so every arm is a fresh process: the same
step's samples (``bench_step.samples_of_step``) train on a fresh copy of the model
(``bench_step.train_arm``, prefix trees with their attention segments, after one warm-up step),
arms alternating, ``--rounds`` times each. Printed per arm: medians of trainer seconds, user and
system seconds, minor faults and the step's peak resident size; then each arm over the defaults.
Timings on a shared CPU are noisy: check ``uptime`` first and read the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MB = 1024 * 1024
ONEDNN_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # runtime/onednn_caches.py
BASELINE = "4 KB pages, map >= 256 KB, no block cache (session 13)"
# Each arm: environment variables for torch, and glibc malloc's thresholds within a step.
# ``step_mmap_threshold``: blocks of that size or more get their own mapping (it replaces
# ``memory.step_mmap_threshold``, which picks 32 MB wherever THP is on); ``trim_threshold``: free
# memory at a heap's top that glibc keeps rather than returning it (unset: 128 KB, glibc's own).
ARMS: dict[str, dict] = {
    BASELINE: {"env": {}, "step_mmap_threshold": 256 * 1024},
    **{
        f"block cache {megabytes} MB{' (the default)' if megabytes == 512 else ''}": {
            "env": {"COOKBOOK_BLOCK_CACHE": "1", "COOKBOOK_BLOCK_CACHE_MB": str(megabytes)},
            "step_mmap_threshold": 256 * 1024,
        }
        for megabytes in (256, 512, 1024)
    },
    # oneDNN's kernel caches at their own default of 1,024 entries each, as before session 24
    # (runtime/onednn_caches.py bounds them to 64 from the package's import on).
    "block cache 512 MB, oneDNN caches of 1024": {
        "env": {
            "COOKBOOK_BLOCK_CACHE": "1",
            "COOKBOOK_BLOCK_CACHE_MB": "512",
            **dict.fromkeys(ONEDNN_CACHES, "1024"),
        },
        "step_mmap_threshold": 256 * 1024,
    },
    "THP for >= 2 MB": {"env": {"THP_MEM_ALLOC_ENABLE": "1"}, "step_mmap_threshold": 256 * 1024},
    "keep 1 GB free at the top": {"env": {}, "step_mmap_threshold": 256 * 1024, "trim_threshold": 1024 * MB},
    "map >= 1 MB": {"env": {}, "step_mmap_threshold": 1 * MB},
    "map >= 2 MB": {"env": {}, "step_mmap_threshold": 2 * MB},
    "map >= 4 MB": {"env": {}, "step_mmap_threshold": 4 * MB},
    "THP, map >= 2 MB": {"env": {"THP_MEM_ALLOC_ENABLE": "1"}, "step_mmap_threshold": 2 * MB},
    "map >= 32 MB": {"env": {}, "step_mmap_threshold": 32 * MB},
    "THP, map >= 32 MB (the opt-in)": {
        "env": {"THP_MEM_ALLOC_ENABLE": "1"},
        "step_mmap_threshold": 32 * MB,
    },
    "THP, map >= 32 MB, keep 1 GB": {
        "env": {"THP_MEM_ALLOC_ENABLE": "1"},
        "step_mmap_threshold": 32 * MB,
        "trim_threshold": 1024 * MB,
    },
}
_M_TRIM_THRESHOLD = -1  # mallopt's parameter number, from glibc's malloc.h
FIELDS = ("trainer_s", "user_s", "system_s", "minor_faults", "peak_rss_gb", "loss")
_RESULT_PREFIX = "RESULT "


def _thp_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown (no /sys/kernel/mm/transparent_hugepage)"


def child(episodes: Path, model: Path, arm: dict) -> None:
    """One arm, in this fresh process: train the step once and print its figures as JSON."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_step import TREES_SEGMENTS, samples_of_step, train_arm

    from cookbook_lib.runtime import memory
    from recipes.grpo.tool_use_game import demo_config

    threshold = arm["step_mmap_threshold"]
    memory.step_mmap_threshold = lambda: threshold  # large_blocks_mapped looks it up at each step
    if arm.get("trim_threshold") is not None:
        memory._mallopt()(_M_TRIM_THRESHOLD, arm["trim_threshold"])

    config = demo_config()
    samples, _ = samples_of_step(episodes, config)
    print(_RESULT_PREFIX + json.dumps(train_arm(model, samples, config, TREES_SEGMENTS)), flush=True)


def run_arm(name: str, episodes: Path, model: Path) -> dict[str, float]:
    env = {variable: value for variable, value in os.environ.items() if variable not in ONEDNN_CACHES}
    env.update(ARMS[name]["env"])  # oneDNN's caches: the arm's capacity, else the library's
    switches = {v for arm in ARMS.values() for v in arm["env"]} - set(ONEDNN_CACHES)
    for variable in switches - ARMS[name]["env"].keys():
        env[variable] = "0"  # off, whatever the shell set (and cookbook_lib's import would set)
    command = [sys.executable, __file__, "--child", json.dumps(ARMS[name])]
    command += ["--episodes", str(episodes), "--model", str(model)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"arm {name!r} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULT_PREFIX) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=Path, help="a step's episodes (else one demo step is sampled)")
    parser.add_argument("--model", type=Path, help="the model that sampled them (with --episodes)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per arm")
    parser.add_argument("--child", metavar="ARM_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="arms to run")
    args = parser.parse_args()
    if args.child:
        child(args.episodes, args.model, json.loads(args.child))
        return
    if args.episodes is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_step import sample_one_step

        from recipes.grpo.tool_use_game import demo_config

        episodes, model = sample_one_step(demo_config(), 16, 2)
    elif args.model is None:
        parser.error("--episodes needs --model: the model that sampled them")
    else:
        episodes, model = args.episodes, args.model
    print(f"transparent huge pages: {_thp_mode()}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    arms = [BASELINE] + [name for name in args.arms if name != BASELINE]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for round_index in range(args.rounds):
        for name in arms:
            runs[name].append(run_arm(name, episodes, model))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    medians = {name: {f: statistics.median(r[f] for r in runs[name]) for f in FIELDS} for name in arms}
    print(f"\n| arm | {' | '.join(FIELDS)} | system / user |\n| --- |{' ---: |' * (len(FIELDS) + 1)}")
    for name, row in medians.items():
        cells = " | ".join(f"{row[f]:.4g}" for f in FIELDS)
        print(f"| {name} | {cells} | {row['system_s'] / max(row['user_s'], 1e-9):.1%} |")
    base = medians[BASELINE]
    for name, row in medians.items():
        if name == BASELINE:
            continue
        print(
            f"\n{name} / baseline: trainer time {row['trainer_s'] / base['trainer_s']:.2f}x, "
            f"system time {row['system_s'] / max(base['system_s'], 1e-9):.2f}x, "
            f"page faults {row['minor_faults'] / max(base['minor_faults'], 1):.3f}x, "
            f"peak RSS {row['peak_rss_gb'] / base['peak_rss_gb']:.2f}x, "
            f"loss difference {abs(row['loss'] - base['loss']):.2e}"
        )


if __name__ == "__main__":
    main()
