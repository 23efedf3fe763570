"""run_summary: a finished run's numbers, read from its logged metrics and its timeline."""

from __future__ import annotations

import math

from cookbook_lib.display.run_summary import finite_mean, run_summary
from cookbook_lib.runtime.timeline import SAMPLING, TRAINER_LANE, TRAINING, Timeline, replica_lane


def test_run_summary_reads_the_metrics_and_the_timeline():
    timeline = Timeline(origin=0.0)
    timeline.add(TRAINER_LANE, TRAINING, 2.0, 6.0)
    timeline.add(replica_lane(0), SAMPLING, 0.0, 2.0)
    timeline.add(replica_lane(0), SAMPLING, 6.0, 10.0)
    metrics = [
        {"step": 0, "val/reward_mean": 0.25},
        {"step": 1, "time/step_s": 4.0, "time/weight_sync_s": 0.5, "reward_mean": 0.5,
         "train/trained_tokens": 10.0, "train/newer_version_tokens": 2.0, "async/policy_age_max": 1.0},
        {"step": 2, "time/step_s": 6.0, "time/weight_sync_s": 1.5, "reward_mean": float("nan"),
         "val/reward_mean": 0.75, "train/trained_tokens": 20.0, "train/mixed_version_replies": 1.0},
    ]  # fmt: skip
    summary = run_summary(metrics, timeline)
    assert summary["wall time (s)"] == 10.0
    assert summary["GRPO steps (s)"] == 10.0 and summary["s per step"] == 5.0
    assert summary["weight sync s per step"] == 1.0
    assert summary["train reward (mean)"] == 0.5  # the NaN step is left out, not averaged in
    assert (summary["val reward, first"], summary["val reward, last"]) == (0.25, 0.75)
    assert summary["trainer idle fraction"] == 0.6 and summary["generator busy fraction"] == 0.6
    assert summary["trained tokens"] == 30.0 and summary["tokens of a newer version"] == 2.0
    assert summary["replies of mixed versions"] == 1.0 and summary["policy age (max)"] == 1.0
    assert summary["dropped stale groups"] == 0.0  # lockstep logs none


def test_finite_mean_skips_what_is_not_a_finite_number():
    assert finite_mean([1, 2.0, None, float("inf"), "x"]) == 1.5
    assert math.isnan(finite_mean([]))
