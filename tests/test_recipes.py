"""The command-line recipes run end to end (small sizes)."""

from __future__ import annotations

import dataclasses

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


def test_the_async_recipe_shares_the_lockstep_flags_and_sizes_its_async_settings():
    from cookbook_lib.grpo.config import WeightSyncType
    from recipes.grpo import tool_use_game, tool_use_game_async

    lockstep, _ = tool_use_game.parse_config(["--steps", "3", "--lr", "1e-5", "--run-name", "x"])
    assert (lockstep.num_steps, lockstep.learning_rate, lockstep.run_name) == (3, 1e-5, "x")
    assert not lockstep.is_async
    assert lockstep == dataclasses.replace(
        tool_use_game.demo_config(), num_steps=3, learning_rate=1e-5, run_name="x"
    )

    parser = tool_use_game_async.make_parser()
    config, _ = tool_use_game.parse_config(
        ["--run-name", "x"], base_config=tool_use_game_async.async_demo_config, parser=parser
    )
    assert config.max_steps_off_policy == 1 and config.num_generator_replicas == 1
    assert config.groups_in_flight == 2 * config.batch_size == 8
    assert config.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    # Everything else is the lockstep demo's.
    assert dataclasses.replace(
        config, max_steps_off_policy=None, groups_in_flight=None
    ) == dataclasses.replace(lockstep, num_steps=config.num_steps, learning_rate=config.learning_rate)

    small, args = tool_use_game.parse_config(
        ["--small", "--weight-sync", "pipeline"],
        base_config=tool_use_game_async.async_demo_config,
        parser=tool_use_game_async.make_parser(),
    )
    assert (small.batch_size, small.groups_in_flight) == (1, 2)  # sized from the small batch
    assert small.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE
    assert (args.val_tasks, args.warm_start_demos, args.warm_start_steps) == (2, 2, 1)
    for text in ("BACKGROUND_PUBLISH", "background-publish", "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"):
        assert (
            tool_use_game_async.weight_sync_type(text) is WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH
        )
    # Replicas as Ray actors, by one flag (the GRPOConfig fields' names as dests).
    on_ray = tool_use_game_async.make_parser().parse_args(["--replicas", "2", "--ray"])
    assert (on_ray.num_generator_replicas, on_ray.generator_placement) == (2, "ray")
    assert tool_use_game_async.make_parser().parse_args([]).generator_placement is None  # the config's
    with pytest.raises(SystemExit):
        tool_use_game_async.make_parser().parse_args(["--weight-sync", "sometimes"])
    with pytest.raises(SystemExit):  # the lockstep recipe has no such flag
        tool_use_game.make_parser().parse_args(["--weight-sync", "pipeline"])


@pytest.mark.slow
def test_the_async_recipe_runs_small(tmp_path, monkeypatch, capsys):
    from cookbook_lib.grpo.config import GRPOConfig
    from cookbook_lib.runtime.timeline import TRAINER_LANE, Timeline
    from recipes.grpo import tool_use_game_async

    monkeypatch.chdir(tmp_path)
    result = tool_use_game_async.main(["--small", "--run-name", "small-async"])
    assert result.run_dir.resolve() == (tmp_path / "runs" / "small-async").resolve()
    saved = GRPOConfig.from_yaml(result.run_dir / "config.yaml")
    assert (saved.max_steps_off_policy, saved.groups_in_flight) == (1, 2)
    assert [m["step"] for m in result.metrics] == [0, 1]
    last = result.metrics[-1]
    assert "val/reward_mean" in last
    for key in ("async/train_wait_s", "async/dropped_stale_groups", "async/policy_age_max"):
        assert key in last, key
    assert last["async/policy_age_max"] <= 1
    assert TRAINER_LANE in Timeline.load(result.run_dir / "timeline.jsonl").lanes()
    assert "step 1/1" in capsys.readouterr().out
