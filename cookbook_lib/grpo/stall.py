"""Telling a user when a run has stopped learning because no group carries a signal.

GRPO trains on the differences within a group. A step whose every group scored alike trains
nothing, and a policy that stays where it is samples such steps again: the state is absorbing.
It happens when one update breaks the reply format (every episode a ``PARSE_FAILURE``,
docs/benchmarks.md session 33), when the tasks are too hard (every reward 0) or too easy (every
reward the same maximum). The step line shows ``zero-var 1.00``; this says what it means and what
to change, once per stretch of such steps, after ``STALLED_AFTER`` of them in a row (a single one
happens by chance in small batches).
"""

from __future__ import annotations

from collections.abc import Mapping

STALLED_AFTER = 2
# A step whose episodes ended as PARSE_FAILURE at least this often reads as a broken format.
MOSTLY = 0.5


def trained_nothing(metrics: Mapping[str, float]) -> bool:
    """Whether a step's metrics say it sampled groups and trained none of them."""
    return "trained_groups" in metrics and not metrics["trained_groups"] and "reward_mean" in metrics


def advice(metrics: Mapping[str, float]) -> str:
    """What a stalled step's episodes suggest doing, from its metrics."""
    if metrics.get("parse_failure_ratio", 0.0) >= MOSTLY:
        return (
            f"{metrics['parse_failure_ratio']:.0%} of its episodes ended with a reply that did not parse: "
            "an update has likely broken the tool-call format. Resume from an earlier checkpoint "
            "with a lower learning_rate or warmup_steps > 0, or warm-start on demonstrations"
        )
    reward = metrics["reward_mean"]
    return (
        f"every episode scored alike (mean reward {reward:.2f}): the tasks may be too hard or too easy "
        "for this policy, or the reward too coarse to tell episodes apart. Mix in tasks of other "
        "difficulty, give partial credit, or raise max_sampling_attempts to sample more groups a step"
    )


class StallWatch:
    """Counts the run's steps in a row that trained nothing; :meth:`after` returns a notice the
    first time the count reaches ``STALLED_AFTER`` in each such stretch, else None."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def after(self, step: int, metrics: Mapping[str, float]) -> str | None:
        if not trained_nothing(metrics):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.in_a_row != STALLED_AFTER:
            return None
        return (
            f"step {step}: the last {self.in_a_row} steps trained nothing (in every group all episodes "
            "scored alike), and a policy that does not change samples such groups again. "
            f"{advice(metrics)}."
        )
