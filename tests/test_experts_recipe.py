"""The experts recipe runs and the experts solve every bundled task."""

from __future__ import annotations

from recipes import experts as demo


def test_demo_experts_solve_every_bundled_task(capsys):
    rows = demo.main([])
    assert [name for name, _ in rows] == [
        "math/train",
        "tool_use_game/train",
        "math/val",
        "tool_use_game/val",
    ]
    for name, report in rows:
        assert report.mean_reward == 1.0, name
        assert report.end_causes == {"TERMINATED": report.num_episodes}, name
    printed = capsys.readouterr().out
    assert "tool_use_game/val" in printed and "mean_reward" in printed
