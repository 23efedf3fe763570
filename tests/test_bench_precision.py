"""bench/bench_precision.py: what it reads from a run's metrics and how it compares the two dtypes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_precision


def _metrics(path: Path, validation: list[float], rewards: list[float], ratio: float) -> Path:
    rows = [{"step": 0, "val/reward_mean": validation[0]}]
    for step, reward in enumerate(rewards, start=1):
        row = {
            "step": step,
            "reward_mean": reward,
            "sampled_tokens": 100.0,
            "time/sampling_s": 10.0,
            "time/training_s": 4.0,
        }
        if step % 2:  # a step whose groups all had one reward trains nothing and logs no train/*
            row |= {"train/ratio_mean": ratio + step * 1e-4, "train/clip_frac": 0.01}
        rows.append(row)
    rows[-1]["val/reward_mean"] = validation[-1]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_learning_figures_read_validation_rewards_ratios_and_time(tmp_path):
    figures = bench_precision.learning_figures(
        _metrics(tmp_path / "m.jsonl", [0.4, 0.9], [0.2, 0.6, 1.0], 0.99)
    )
    assert figures["validation"] == [0.4, 0.9]
    assert figures["train_reward_mean"] == pytest.approx(0.6)
    assert (figures["ratio_min"], figures["ratio_max"]) == pytest.approx((0.9901, 0.9903))
    assert figures["clip_frac_mean"] == pytest.approx(0.02 / 3)  # untrained steps count as no clipping
    assert (figures["sampling_s"], figures["training_s"]) == (30.0, 12.0)
    assert figures["sampled_tok_per_s"] == pytest.approx(10.0)


def test_the_report_compares_bf16_with_float32_over_the_seeds(tmp_path, capsys):
    resources = {"wall_s": 100.0, "user_s": 80.0, "system_s": 8.0, "peak_rss_gb": 3.0, "minor_faults": 1.0}
    results = {}
    for seed in (0, 1):
        fp32 = bench_precision.learning_figures(_metrics(tmp_path / f"f{seed}", [0.4, 0.8], [0.5], 1.0))
        bf16 = bench_precision.learning_figures(_metrics(tmp_path / f"b{seed}", [0.4, 0.9], [0.7], 0.99))
        results[("float32", seed)] = {**resources, **fp32}
        results[("bfloat16", seed)] = {**resources, "wall_s": 60.0, **bf16}
    bench_precision.report(results, [0, 1])
    out = capsys.readouterr().out
    assert "float32 mean of 2: validation 0.400 -> 0.800 (gain +0.400)" in out
    assert "bfloat16 mean of 2: validation 0.400 -> 0.900 (gain +0.500)" in out
    assert "wall_s 0.60x" in out and "final validation +0.100" in out and "train reward +0.200" in out


def test_a_finished_run_is_read_back_not_run_again(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_precision, "RUNS", tmp_path)
    figures = {"wall_s": 1.0, "user_s": 1.0, "system_s": 0.1, "peak_rss_gb": 1.0, "minor_faults": 1.0}
    folder = tmp_path / bench_precision.run_name("bfloat16", 3)
    folder.mkdir()
    (folder / bench_precision.FIGURES).write_text(json.dumps(figures))

    def no_run(*args, **kwargs):
        raise AssertionError("ran a finished run again")

    monkeypatch.setattr(bench_precision.subprocess, "Popen", no_run)
    assert bench_precision.run_demo("bfloat16", 3, tmp_path, []) == figures
