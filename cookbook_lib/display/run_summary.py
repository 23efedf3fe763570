"""A finished run in a few numbers, for the tables that compare runs (lockstep against async, one
weight-sync mode against another): read from what the run logged (its metrics, its timeline),
never re-derived from its episodes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cookbook_lib.display.timeline_plots import idle_summary
from cookbook_lib.runtime.timeline import Timeline


def finite_mean(values: Iterable[Any]) -> float:
    """The mean of the finite numbers among ``values`` (NaN when there are none)."""
    kept = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan


def run_summary(metrics: Sequence[Mapping[str, Any]], timeline: Timeline) -> dict[str, float]:
    """Wall time, time in GRPO steps, rewards, who sat idle, what went stale, how old the policy
    was, and how many versions sampled what trained; ``metrics`` is the run's (``TrainResult.metrics``)."""
    steps = [m for m in metrics if m["step"] > 0]
    validation = [m["val/reward_mean"] for m in metrics if "val/reward_mean" in m]
    idle = idle_summary(timeline.spans())
    return {
        "wall time (s)": idle["wall_s"],
        "GRPO steps (s)": sum(m["time/step_s"] for m in steps),
        "s per step": finite_mean(m["time/step_s"] for m in steps),
        "weight sync s per step": finite_mean(m["time/weight_sync_s"] for m in steps),
        "train reward (mean)": finite_mean(m.get("reward_mean") for m in steps),
        "val reward, first": validation[0] if validation else math.nan,
        "val reward, last": validation[-1] if validation else math.nan,
        "trainer idle fraction": idle["trainer_idle_fraction"],
        "generator busy fraction": idle["generator_busy_fraction"],
        "dropped stale groups": sum(m.get("async/dropped_stale_groups", 0.0) for m in steps),
        "policy age (mean)": finite_mean(m.get("async/policy_age_mean", 0.0) for m in steps),
        "policy age (max)": max((m.get("async/policy_age_max", 0.0) for m in steps), default=0.0),
        "trained tokens": sum(m.get("train/trained_tokens", 0.0) for m in steps),
        "tokens of a newer version": sum(m.get("train/newer_version_tokens", 0.0) for m in steps),
        "replies of mixed versions": sum(m.get("train/mixed_version_replies", 0.0) for m in steps),
    }
