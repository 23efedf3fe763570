"""Step metrics: episode_stats against hand-computed values, the JSONL log, truncation, W&B offline."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cookbook_lib.envs.base import Task
from cookbook_lib.rollout.episode import EndCause, Episode, Turn
from cookbook_lib.runtime.metrics import (
    METRICS_FILE,
    MetricsLogger,
    NullLogger,
    dump_episodes,
    episode_stats,
    read_metrics,
    truncate_metrics,
    wandb_run_id,
)

ROOT = Path(__file__).resolve().parents[1]


def _turn(prompt: list[int], sampled: list[int]) -> Turn:
    return Turn(prompt, sampled, [-0.5] * len(sampled), [0] * len(sampled))


def _episode(cause: EndCause, reward: float, turns: list[Turn], metrics: dict, num_turns: int) -> Episode:
    return Episode(Task("q"), [], reward, cause, metrics=metrics, num_turns=num_turns, turns=turns)


def _batch() -> list[Episode]:
    """Six episodes, one per end cause. Token counts per episode: 7, 5, 2, 0, 3+4, 3."""
    return [
        _episode(
            EndCause.TERMINATED,
            1.0,
            [_turn([1, 2, 3], [4, 5]), _turn([1, 2, 3, 4, 5, 6], [7])],
            {"tool_calls": 2, "tool_errors": 0},
            2,
        ),
        _episode(
            EndCause.CONTEXT_OVERFLOW, 0.0, [_turn([1, 2], [3, 4, 5])], {"tool_calls": 1, "tool_errors": 1}, 1
        ),
        _episode(
            EndCause.PARSE_FAILURE,
            -1.0,
            [_turn([9], [8])],
            {"tool_calls": 0, "tool_errors": 0, "solved": True},
            1,
        ),
        _episode(EndCause.ERROR, 0.0, [], {}, 0),
        # History rewritten before the second turn: two sequences of 3 and 4 tokens.
        _episode(
            EndCause.MAX_TURNS,
            0.5,
            [_turn([1, 2], [3]), _turn([5, 6], [7, 8])],
            {"tool_calls": 4, "tool_errors": 2},
            2,
        ),
        _episode(
            EndCause.ENV, 0.5, [_turn([1], [2, 3])], {"tool_calls": 3, "tool_errors": 0, "note": "text"}, 1
        ),
    ]


def test_episode_stats_match_hand_computed_values():
    expected = {
        "terminated_ratio": 1 / 6,
        "truncated_ratio": 4 / 6,  # overflow, parse failure, max turns, env; ERROR is not one
        "context_overflow_ratio": 1 / 6,
        "parse_failure_ratio": 1 / 6,
        "max_turns_ratio": 1 / 6,
        "env_truncated_ratio": 1 / 6,
        "error_ratio": 1 / 6,
        "reward_mean": 1 / 6,  # (1 + 0 - 1 + 0 + 0.5 + 0.5) / 6
        "reward_std": math.sqrt((25 + 1 + 49 + 1 + 4 + 4) / 36 / 6),
        "turns_mean": 7 / 6,
        "sampled_tokens": 12.0,  # 3 + 3 + 1 + 0 + 3 + 2
        "episode_tokens_mean": 4.0,  # (7 + 5 + 2 + 0 + 7 + 3) / 6
        "env/tool_calls": 2.0,  # (2 + 1 + 0 + 4 + 3) / 5: the ERROR episode reports none
        "env/tool_errors": 0.6,
        "env/solved": 1.0,  # reported by one episode only; the string metric is left out
    }
    stats = episode_stats(_batch())
    assert stats == pytest.approx(expected)
    assert set(stats) == set(expected)


def test_episode_stats_prefix_and_empty_input():
    plain = episode_stats(_batch())
    prefixed = episode_stats(_batch(), prefix="val/")
    assert prefixed == {f"val/{name}": value for name, value in plain.items()}
    with pytest.raises(ValueError, match="at least one episode"):
        episode_stats([])


def _strict_json(line: str) -> dict:
    def reject(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


def test_logger_writes_one_strict_json_line_per_step(tmp_path):
    logger = MetricsLogger(tmp_path, wandb_project=None, run_name="jsonl")
    logger.log(1, {"loss": 0.5, "reward": float("nan"), "kl": float("inf"), "nested": [float("-inf"), 2]})
    logger.log(2, {"loss": np.float32(0.25), "tokens": torch.tensor(7), "name": "x"})
    # Readable before close(): each line is flushed and fsync-ed as logged.
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [_strict_json(line) for line in lines] == [
        {"step": 1, "loss": 0.5, "reward": None, "kl": None, "nested": [None, 2]},
        {"step": 2, "loss": 0.25, "tokens": 7, "name": "x"},
    ]
    with pytest.raises(ValueError, match="'step'"):
        logger.log(3, {"step": 3})
    logger.close()
    logger.close()  # twice is harmless
    assert read_metrics(tmp_path) == [_strict_json(line) for line in lines]


def test_truncate_metrics_drops_later_steps_and_appending_continues(tmp_path):
    with MetricsLogger(tmp_path, wandb_project=None, run_name="t") as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    truncate_metrics(tmp_path, after_step=3)
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2, 3]
    assert sorted(path.name for path in tmp_path.iterdir()) == [METRICS_FILE]  # no temp file left
    with MetricsLogger(tmp_path, wandb_project=None, run_name="t") as logger:
        logger.log(4, {"loss": 4.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 4.5)]


def test_a_line_cut_by_a_kill_is_dropped(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]
    with MetricsLogger(tmp_path, wandb_project=None, run_name="t") as logger:
        logger.log(2, {"loss": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_truncate_and_read_without_a_metrics_file(tmp_path):
    truncate_metrics(tmp_path, after_step=0)
    assert read_metrics(tmp_path) == []
    assert not (tmp_path / METRICS_FILE).exists()


def test_dump_episodes_round_trips(tmp_path):
    episodes = _batch()
    path = dump_episodes(tmp_path, 123, episodes)
    assert path == tmp_path / "episodes" / "step_000123.jsonl"
    loaded = [Episode.from_dict(json.loads(line)) for line in path.read_text().splitlines()]
    assert loaded == episodes


def test_null_logger_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with NullLogger() as logger:
        assert logger.log(1, {"loss": float("nan")}) is None
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_wandb_is_not_imported_without_a_project(tmp_path):
    code = (
        "import sys; from pathlib import Path; from cookbook_lib.runtime.metrics import MetricsLogger;"
        f"MetricsLogger(Path({str(tmp_path)!r}), wandb_project=None, run_name='x').log(1, {{'a': 1}});"
        "assert 'wandb' not in sys.modules, 'wandb was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1}]


def test_wandb_offline_run_is_written_and_resumed_under_the_same_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    run_dir = tmp_path / "run"
    for steps in ([1, 2], [3]):  # the second logger is the resumed process
        if steps == [3]:
            # wandb names a run's folder by its start time in whole seconds: two starts within one
            # second would share a folder (seen in CI on a quiet machine).
            time.sleep(1.0)
        with MetricsLogger(
            run_dir, wandb_project="cookbook-test", run_name="wb", config={"lr": 1e-3}
        ) as logger:
            for step in steps:
                logger.log(step, {"loss": 1.0 / step, "reward": float("nan")})
    run_id = wandb_run_id("wb")
    offline_runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline_runs) == 2, list((run_dir / "wandb").iterdir())
    for folder in offline_runs:
        assert (folder / f"run-{run_id}.wandb").stat().st_size > 0
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2, 3]
    assert wandb_run_id("wb") != wandb_run_id("wb2")
