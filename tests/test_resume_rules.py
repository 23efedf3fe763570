"""Which settings may change on resume: every field classified once, refusals naming the fields,
and the record of each start in config_history.jsonl. (Runs that extend: tests/test_grpo_train.py.)"""

from __future__ import annotations

import dataclasses
import enum

import pytest

from cookbook_lib.grpo import resume_rules
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.resume_rules import (
    CHANGEABLE_ON_RESUME,
    FIXED_ON_RESUME,
    changed_fields,
    check_resume,
    read_config_history,
    record_config,
    resume_problems,
    unclassified_fields,
)

FIELDS = [f.name for f in dataclasses.fields(GRPOConfig)]
BASE = GRPOConfig(run_name="r", runs_dir="runs", num_steps=10)


def test_every_config_field_is_classified_exactly_once():
    # A new GRPOConfig field fails here until it is put in CHANGEABLE_ON_RESUME or FIXED_ON_RESUME.
    assert unclassified_fields() == [], "classify these fields in cookbook_lib/grpo/resume_rules.py"
    assert sorted(CHANGEABLE_ON_RESUME + FIXED_ON_RESUME) == sorted(FIELDS)  # no stale or doubled names


def test_the_settings_the_lead_named_are_classified_as_decided():
    for name in ("num_steps", "validation_interval", "val_episodes_per_task", "checkpoint_interval"):
        assert name in CHANGEABLE_ON_RESUME
    for name in ("wandb_project", "resume", "device", "generator_backend", "keep_last_checkpoints"):
        assert name in CHANGEABLE_ON_RESUME
    for name in ("model", "learning_rate", "loss_type", "episodes_per_task", "batch_size", "seed"):
        assert name in FIXED_ON_RESUME
    for name in ("temperature", "top_p", "max_tokens_per_turn", "max_turns", "dtype"):
        assert name in FIXED_ON_RESUME


def another_value(value: object) -> object:
    """Some other value of the same kind (validity does not matter: the rules compare only)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    if isinstance(value, enum.Enum):
        return next(member for member in type(value) if member != value)
    if isinstance(value, str):
        return value + "-other"
    return 3  # None


def test_changeable_settings_may_all_change_at_once():
    changes = {name: another_value(getattr(BASE, name)) for name in CHANGEABLE_ON_RESUME}
    changes["num_steps"] = 20
    assert resume_problems(BASE, dataclasses.replace(BASE, **changes), checkpoint_step=10) == []


@pytest.mark.parametrize("name", FIXED_ON_RESUME)
def test_each_fixed_setting_is_refused_by_name(name):
    old = getattr(BASE, name)
    new = dataclasses.replace(BASE, **{name: another_value(old)})
    (problem,) = resume_problems(BASE, new, checkpoint_step=4)
    assert f"({name}: " in problem and f"restore {name}," in problem


def test_a_field_nobody_classified_is_refused(monkeypatch):
    monkeypatch.setattr(
        resume_rules, "CHANGEABLE_ON_RESUME", tuple(n for n in CHANGEABLE_ON_RESUME if n != "wandb_project")
    )
    (problem,) = resume_problems(BASE, dataclasses.replace(BASE, wandb_project="p"), checkpoint_step=1)
    assert "wandb_project: None in the run, 'p' now" in problem


def test_num_steps_may_grow_or_stay_but_not_drop_below_the_checkpoint(tmp_path):
    assert resume_problems(BASE, dataclasses.replace(BASE, num_steps=8), checkpoint_step=8) == []
    with pytest.raises(ValueError, match=r"num_steps=7 is below step 8 .* set num_steps >= 8") as info:
        check_resume(tmp_path, BASE, dataclasses.replace(BASE, num_steps=7, seed=5), checkpoint_step=8)
    assert "seed: 0 in the run, 5 now" in str(info.value)  # every problem at once


def test_record_config_keeps_the_latest_config_and_appends_what_changed(tmp_path):
    record_config(tmp_path, BASE, start_step=0)
    extended = dataclasses.replace(BASE, num_steps=20, wandb_project="p")
    record_config(tmp_path, extended, start_step=10)
    assert GRPOConfig.from_yaml(tmp_path / "config.yaml") == extended
    history = read_config_history(tmp_path)
    assert [(h["start_step"], h["num_steps"]) for h in history] == [(0, 10), (10, 20)]
    assert history[1]["changed"] == {
        "num_steps": {"before": 10, "after": 20},
        "wandb_project": {"before": None, "after": "p"},
    }
    assert changed_fields(BASE, BASE) == {}


def test_record_config_tolerates_a_config_yaml_from_another_version(tmp_path):
    (tmp_path / "config.yaml").write_text("num_steps: 5\nold_setting: 1\n")
    record_config(tmp_path, BASE, start_step=0)
    changed = read_config_history(tmp_path)[0]["changed"]
    assert changed["num_steps"] == {"before": 5, "after": 10}
    assert changed["old_setting"] == {"before": 1, "after": None}
