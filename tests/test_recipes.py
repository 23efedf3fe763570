"""The command-line recipes run end to end (small sizes)."""

from __future__ import annotations

import pytest

from recipes import evaluate as evaluate_recipe


@pytest.mark.slow
def test_evaluate_recipe_runs_the_embedded_model_on_both_environments(tmp_path, capsys):
    rows = evaluate_recipe.main(
        [
            "--num-tasks",
            "1",
            "--episodes-per-task",
            "2",
            "--max-tokens-per-turn",
            "16",
            "--runs-dir",
            str(tmp_path),
        ]
    )
    assert [name for name, _ in rows] == ["math/val", "tool_use_game/val"]
    for _, report in rows:
        assert report.num_episodes == 2 and report.episodes_path.is_file()
    assert "mean_reward" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tool_use_game", "math_env", "single_turn"])
def test_grpo_recipes_run_small(recipe, tmp_path, monkeypatch, capsys):
    import importlib

    monkeypatch.chdir(tmp_path)  # runs/ goes under the temporary folder
    module = importlib.import_module(f"recipes.grpo.{recipe}")
    result = module.main(["--small", "--run-name", f"small-{recipe}"])
    assert result.run_dir.resolve() == (tmp_path / "runs" / f"small-{recipe}").resolve()
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert "val/reward_mean" in result.metrics[-1]
    assert "step 1/1" in capsys.readouterr().out
