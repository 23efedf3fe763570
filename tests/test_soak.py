"""Soak: 200 GRPO steps with injected faults and a kill -9 in the middle, then a resume.

The run trains the tiny model in its own process (tests/soak_run.py: one-turn episodes of an env
whose replies go through a real tool; faults in ~4% of resets, steps and tool calls). Once it
has checkpointed and passed step 95 it is killed with SIGKILL; rerunning it resumes from its last
checkpoint (step 90, every 10 steps) and finishes. Afterwards:

- metrics.jsonl has every step 0..200 exactly once (steps 91..95 were redone, not repeated);
- resident memory of the resumed process, after a warm-up, stays flat: its median over the last
  steps within RSS_GROWTH_LIMIT of its median over the first, no reading far above it;
- disk is bounded by the checkpoint setting: exactly ``keep_last_checkpoints`` checkpoints and
  nothing half-written, and the rest of the run folder (per-step records) stays small;
- every environment the finishing process created was closed exactly once, and the killed one
  closed none twice and left at most the episodes of one group unclosed (it was killed mid-group);
- faults of each kind happened, and the run went on through them.

A few minutes on a shared 2-core machine: each step samples 3 tokens for 2 episodes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from soak_run import CHECKPOINT_INTERVAL, KEEP_LAST_CHECKPOINTS

from cookbook_lib.runtime.checkpoint import CHECKPOINTS_DIR, LATEST_FILE, checkpoint_step, latest_checkpoint
from cookbook_lib.runtime.metrics import read_metrics

WORKER = Path(__file__).with_name("soak_run.py")
NUM_STEPS = 200
KILL_AFTER_STEP = 95  # between the checkpoints at 90 and 100: steps 91..95 are trained twice
EPISODES_IN_FLIGHT = 2  # batch_size 1 x episodes_per_task 2, lockstep: one group at a time
WARM_UP_STEPS = 20  # of the resumed process: imports, first allocations, the first checkpoint save
# Leak check: the median of the last WINDOW_STEPS readings against the median of the first
# WINDOW_STEPS after warm-up, 60 steps apart. Medians, because a checkpoint step reads 10-16 MiB
# above its neighbours (the save's buffers, handed back by the next step): the highest reading
# against the first one measured that spike, not growth, and failed CI at 20.2 MiB. Measured on
# the AMD EPYC: medians 2 MiB apart over the 90 steps. A leak of 0.2 MiB a step, an episode's
# tensors kept by mistake, moves them 12 MiB.
WINDOW_STEPS = 30
RSS_GROWTH_LIMIT = 10 * 2**20
RSS_SPIKE_LIMIT = 40 * 2**20  # bytes: highest reading after warm-up above the first window's median
OTHER_FILES_LIMIT = 30 * 2**20  # bytes: everything in the run folder but checkpoints/


def start(model_dir: str, runs_dir: Path, events: Path, rss: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, str(WORKER), model_dir, str(runs_dir), str(events), str(rss), str(NUM_STEPS)]
    environment = {**os.environ, "WANDB_MODE": "offline"}
    with log.open("ab") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)


def last_logged_step(run_dir: Path) -> int:
    metrics = read_metrics(run_dir)
    return metrics[-1]["step"] if metrics else -1


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc (Linux)")
def test_soak_200_steps_with_faults_and_a_kill_stays_flat(tiny_model_dir, tmp_path):
    runs_dir, events, log = tmp_path / "runs", tmp_path / "events.txt", tmp_path / "output.txt"
    run_dir = runs_dir / "soak"
    rss_killed, rss_resumed = tmp_path / "rss_killed.txt", tmp_path / "rss_resumed.txt"

    # 1. Train until past step 95 with a checkpoint on disk, then kill -9.
    first = start(tiny_model_dir, runs_dir, events, rss_killed, log)
    deadline = time.monotonic() + 300
    while last_logged_step(run_dir) < KILL_AFTER_STEP or latest_checkpoint(run_dir) is None:
        assert first.poll() is None, f"the run ended before it was killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach step 95 in 300 s"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL
    killed_at = last_logged_step(run_dir)
    resumes_after = checkpoint_step(latest_checkpoint(run_dir))  # 90, unless the kill came late
    assert KILL_AFTER_STEP <= killed_at < NUM_STEPS and resumes_after % CHECKPOINT_INTERVAL == 0

    # 2. Rerun: it resumes from the last checkpoint and finishes.
    second = start(tiny_model_dir, runs_dir, events, rss_resumed, log)
    assert second.wait(timeout=400) == 0, log.read_text()[-3000:]

    # Every step once, none lost or repeated.
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS + 1))

    # Memory: flat after warm-up.
    readings = [tuple(map(int, line.split())) for line in rss_resumed.read_text().splitlines()]
    assert [step for step, _ in readings] == list(range(resumes_after + 1, NUM_STEPS + 1))
    after_warm_up = [rss for _, rss in readings[WARM_UP_STEPS:]]
    floor_start = statistics.median(after_warm_up[:WINDOW_STEPS])
    floor_end = statistics.median(after_warm_up[-WINDOW_STEPS:])
    growth, spike = floor_end - floor_start, max(after_warm_up) - floor_start
    print(
        f"soak: RSS median {floor_start / 2**20:.1f} MiB after warm-up,"
        f" {floor_end / 2**20:.1f} MiB at the end"
        f" ({growth / 2**20:+.1f}); highest reading +{spike / 2**20:.1f} MiB"
    )
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.1f} MiB over {len(after_warm_up)} steps"
    assert spike < RSS_SPIKE_LIMIT, f"a step read {spike / 2**20:.1f} MiB above the resident floor"

    # Disk: the checkpoint setting bounds it.
    checkpoints = run_dir / CHECKPOINTS_DIR
    assert sorted(p.name for p in checkpoints.iterdir()) == [LATEST_FILE, "step_000190", "step_000200"]
    assert len(list(checkpoints.glob("step_*"))) == KEEP_LAST_CHECKPOINTS
    others = folder_bytes(run_dir) - folder_bytes(checkpoints)
    print(
        f"soak: checkpoints/ {folder_bytes(checkpoints) / 2**20:.0f} MiB, the rest {others / 2**20:.1f} MiB"
    )
    assert others < OTHER_FILES_LIMIT, f"{others / 2**20:.1f} MiB outside checkpoints/"

    # Environments: each closed exactly once (the killed process could not close those in flight).
    history: dict[str, list[str]] = collections.defaultdict(list)
    for line in events.read_text().splitlines():
        event, env_id = line.split()
        history[env_id].append(event)
    for pid, finished in ((first.pid, False), (second.pid, True)):
        envs = {env_id: seen for env_id, seen in history.items() if env_id.startswith(f"{pid}-")}
        closes = collections.Counter(seen.count("close") for seen in envs.values())
        assert set(closes) <= {0, 1}, f"an environment of process {pid} was closed twice"
        assert closes[0] == 0 if finished else closes[0] <= EPISODES_IN_FLIGHT, closes
        played = NUM_STEPS - resumes_after if finished else killed_at
        assert len(envs) >= EPISODES_IN_FLIGHT * played  # one per episode

    # Faults of every kind happened, and the run went on.
    kinds = collections.Counter(event for seen in history.values() for event in seen)
    print(f"soak: environment events {dict(kinds)}")
    assert min(kinds["reset_fault"], kinds["step_fault"], kinds["tool_fault"]) > 0, kinds
    assert sum(m.get("num_error_episodes", 0) for m in read_metrics(run_dir)) > 0
    episodes = [
        json.loads(line) for line in (run_dir / "episodes" / "step_000200.jsonl").read_text().splitlines()
    ]
    assert len(episodes) == EPISODES_IN_FLIGHT
