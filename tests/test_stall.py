"""The notice a run prints when its steps stop training (every group's episodes scored alike)."""

from __future__ import annotations

import pytest
from test_grpo_train import TASKS, tiny_config

from cookbook_lib.grpo.stall import STALLED_AFTER, StallWatch
from cookbook_lib.grpo.train import train_single_turn

TRAINED = {"trained_groups": 2.0, "reward_mean": 0.5, "parse_failure_ratio": 0.0}
ALIKE = {"trained_groups": 0.0, "reward_mean": 0.0, "parse_failure_ratio": 0.0}
BROKEN = {"trained_groups": 0.0, "reward_mean": 0.0, "parse_failure_ratio": 1.0}


def notices(steps: list[dict]) -> list[tuple[int, str]]:
    watch = StallWatch()
    return [(step, note) for step, metrics in enumerate(steps, 1) if (note := watch.after(step, metrics))]


def test_a_notice_comes_once_a_stretch_after_enough_steps_in_a_row():
    steps = [TRAINED, ALIKE, TRAINED, ALIKE, ALIKE, ALIKE, ALIKE, TRAINED, ALIKE, ALIKE]
    assert STALLED_AFTER == 2
    assert [step for step, _ in notices(steps)] == [5, 10]


def test_a_validation_only_line_is_not_a_step_that_trained_nothing():
    validation = {"val/reward_mean": 0.2}  # step 0: no trained_groups
    assert notices([validation, ALIKE, validation]) == []


@pytest.mark.parametrize(
    ("metrics", "says"),
    [
        (BROKEN, "100% of its episodes ended with a reply that did not parse"),
        (ALIKE, "every episode scored alike (mean reward 0.00)"),
        ({**ALIKE, "reward_mean": 1.0}, "every episode scored alike (mean reward 1.00)"),
    ],
)
def test_the_notice_says_what_the_episodes_suggest(metrics, says):
    [(_, note)] = notices([metrics, metrics])
    assert note.startswith("step 2: the last 2 steps trained nothing")
    assert says in note


def test_a_run_whose_rewards_never_differ_says_so(tiny_model_dir, tmp_path, capsys):
    config = tiny_config(tiny_model_dir, tmp_path, num_steps=2, validation_interval=0, checkpoint_interval=0)
    train_single_turn(config, tasks=TASKS, reward_fn=lambda task, reply: 0.0)
    out = capsys.readouterr().out
    assert "step 2: the last 2 steps trained nothing" in out
    assert "mean reward 0.00" in out
