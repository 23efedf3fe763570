"""The arithmetic behind bench_async's figures: cores used, the bound for the same CPU work, targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_async


def test_cores_used_is_cpu_seconds_per_wall_second_from_step_one_to_the_step_before_the_last():
    # (wall, process CPU) at the end of each step; step 6 validates and saves, so it is left out.
    ends = {1: (10.0, 15.0), 2: (20.0, 30.0), 5: (50.0, 75.0), 6: (90.0, 200.0)}
    assert bench_async.cores_used(ends, last_step=6) == pytest.approx((75.0 - 15.0) / (50.0 - 10.0))
    assert bench_async.cores_used({1: (1.0, 1.0), 2: (2.0, 2.0)}, last_step=2) is None  # no window


def test_the_bound_here_is_locksteps_cpu_work_over_every_core():
    assert bench_async.machine_bound(1.46, cores=2) == pytest.approx(0.73)
    assert bench_async.machine_bound(3.0, cores=2) == 1.0  # never above lockstep itself
    assert bench_async.machine_bound(None, cores=2) is None


def test_targets_report_the_bound_beside_the_wall_time_target():
    mix = {"turns_1": 0.5, "turns_2": 0.5}
    lockstep = {"trained_mix": mix, "wall_s": 100.0, "val_reward": [(6, 0.30)]}
    arm = lockstep | {"wall_s": 74.0, "val_reward": [(6, 0.29)], "oldest_trained_token_age": 2}
    arm["max_steps_off_policy"] = 2
    result = bench_async.targets(arm, lockstep, bound_here=0.73)
    assert result["wall time"] == (False, "0.74x lockstep; target <= 0.6x (bound on this machine 0.73x)")
    assert result["validation"][0] and result["length mix"][0] and result["token age"][0]
