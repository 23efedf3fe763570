"""The GPU check runs on a CPU (tiny random-init model) and reports each phase in one summary."""

from __future__ import annotations

import json

import pytest

from cookbook_lib.runtime import gpu_check


def test_pytest_counts_reads_the_closing_line():
    log = "....\n= 14 passed, 7 skipped, 2 deselected in 58.46s ="
    assert gpu_check.pytest_counts(log) == "14 passed, 7 skipped, 2 deselected in 58.46s"
    assert gpu_check.pytest_counts("Traceback ...") == "no pytest summary found"


def test_demo_summary_reads_validation_and_step_times(tmp_path):
    lines = [
        {"step": 0, "val/reward_mean": 0.25},
        {"step": 1, "time/step_s": 2.0},
        {"step": 2, "time/step_s": 4.0, "val/reward_mean": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = gpu_check.demo_summary(tmp_path)
    assert "2 GRPO steps" in summary and "0.25 (step 0) -> 0.75" in summary and "3.0 s" in summary
    assert gpu_check.demo_summary(tmp_path / "missing") == "no metrics written"


@pytest.mark.slow
def test_the_whole_check_runs_on_a_cpu(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.txt").read_text()
    assert "tests: ok" in summary and "demo: ok" in summary and "bench: ok" in summary
    assert "HFGenerator" in summary and "GRPO step" in summary
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert {row["dtype"] for row in report["decode"]} == {"float32", "bfloat16"}
    assert {row["method"] for row in report["decode"]} == {
        "padded generate (baseline)",
        "HFGenerator, growing cache",
        "HFGenerator, fixed slots",
    }
    assert [found["dtype"] for found in report["profile"]] == ["float32", "bfloat16"]
    assert all(found["launches"] > 0 for found in report["profile"])
    assert "fixed slots" in summary and "launches" in summary
    # No library noise in what a user sees.
    captured = capsys.readouterr()
    assert "Writing model shards" not in captured.out + captured.err
