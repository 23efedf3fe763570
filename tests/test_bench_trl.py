"""bench_trl's TRL side sees the game we train on: the same tools, schemas, results and score."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_trl

from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks


def _task(tier: int):
    return next(t for t in load_tool_use_game_tasks("train") if t.metadata["tier"] == tier)


def test_trl_builds_each_tools_schema_from_its_method_as_our_env_offers_it():
    # TRL renders an environment's tools from its methods' signatures and docstrings.
    tools = bench_trl._GameTools()
    ours = {spec["function"]["name"]: spec["function"] for spec in ToolUseGameEnv().tool_specs}
    for name, spec in ours.items():
        theirs = get_json_schema(getattr(tools, name))["function"]
        assert theirs["name"] == name
        assert theirs["description"] == spec["description"]
        wanted = {
            key: (value["type"], value.get("description"))
            for key, value in spec["parameters"]["properties"].items()
        }
        got = {
            key: (value["type"], value.get("description"))
            for key, value in theirs["parameters"]["properties"].items()
        }
        assert got == wanted
        assert sorted(theirs["parameters"].get("required", [])) == sorted(
            spec["parameters"].get("required", [])
        )


def test_the_tools_return_what_the_env_returns_and_raise_on_an_unknown_key():
    task = _task(2)
    env = ToolUseGameEnv()
    asyncio.run(env.reset(task))
    tools = bench_trl._GameTools()
    tools.reset(prompt=[], facts=json.dumps(task.metadata["facts"]), target=str(task.target))
    key = next(iter(task.metadata["facts"]))
    calls = [("c1", "list_fact_keys", {}), ("c2", "lookup", {"key": key})]
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls
        ],
    }
    listing = asyncio.run(env.step(message))
    env_results = [m["content"] for m in listing.messages if m["role"] == "tool"]
    assert env_results == [tools.list_fact_keys(), tools.lookup(key)]
    assert tools.calculator("6 * 7") == "42"
    try:
        tools.lookup("no_such_key")
    except Exception as error:  # TRL turns it into {"error": ...} for the model
        assert "unknown fact key" in str(error)
    else:
        raise AssertionError("an unknown key must raise")


def test_the_reward_is_the_games_score_of_the_final_reply():
    target = ["42"] * 4
    completions = [
        [{"role": "assistant", "content": " 42 "}],
        [{"role": "assistant", "content": "41"}],
        [{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}],  # no final reply
        [],
    ]
    assert bench_trl.game_reward(completions, target) == [1.0, 0.0, 0.0, 0.0]


def test_the_single_turn_reward_is_the_nearest_numbers_closeness_and_the_work_is_the_recipes():
    replies = [" 42 ", "21", "12 + 11 = 22", "The answer is 7.", "", "-3.0 it is", "forty-two", "900"]
    targets = ["42", "42", "23", "7", "42", "-3", "42", "42"]
    completions = [[{"role": "assistant", "content": reply}] for reply in replies]
    rewards = bench_trl.math_reward(completions, targets)
    assert rewards == pytest.approx([1.0, 0.5, 1 - 1 / 23, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert bench_trl.math_reward([[]], ["1"]) == [0.0]  # no reply at all
    config = bench_trl.single_turn_config(Path("m"), 3, 5, "float32", Path("w"), 2e-5)
    config.validate({"WANDB_MODE": "offline"})
    assert (config.batch_size, config.episodes_per_task, config.max_tokens_per_turn) == (4, 8, 16)
    assert config.max_sampling_attempts == 1 and config.seed == 3
    assert all(task.metadata["level"] == 1 for task in bench_trl.math_level1_tasks())


def test_trls_dataset_is_the_tasks_our_side_samples_in_order():
    from cookbook_lib.grpo.lockstep import tasks_for_step

    config = bench_trl.single_turn_config(Path("m"), 1, 3, "float32", Path("w"), 2e-5)
    tasks = bench_trl.math_level1_tasks()
    ordered, rows = bench_trl.trl_rows(config, tasks, 4, "Reply with a number.")
    assert ordered == [t for step in (1, 2, 3) for t in tasks_for_step(tasks, config, step, 0, 4)]
    assert rows["target"] == [str(task.target) for task in ordered] and len(rows["prompt"]) == 12
    assert rows["prompt"][5] == [
        {"role": "system", "content": "Reply with a number."},
        {"role": "user", "content": ordered[5].prompt},
    ]


def test_ours_config_settings_are_read_as_yaml_and_name_their_run_folder(tmp_path):
    overrides = bench_trl.parse_overrides(["loss_normalizer=batch_groups", "learning_rate=1e-5"])
    assert overrides == {"loss_normalizer": "batch_groups", "learning_rate": 1e-5}
    config = bench_trl.our_config(tmp_path / "model", 2, 5, "float32", tmp_path, 5e-5, overrides)
    assert (config.loss_normalizer, config.learning_rate) == ("batch_groups", 1e-5)
    assert config.run_name == "ours-learning_rate=1e-05-loss_normalizer=batch_groups-seed2"
    assert bench_trl.our_config(tmp_path / "model", 2, 5, "float32", tmp_path, 5e-5).run_name == "ours-seed2"


@pytest.mark.parametrize("bad", ["loss_normalizer", "=1"])
def test_an_ours_config_setting_without_a_key_and_value_is_refused(bad):
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench_trl.parse_overrides([bad])


def test_an_unknown_value_fails_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="loss_normalizer"):
        bench_trl.our_config(tmp_path, 0, 1, "float32", tmp_path, 5e-5, {"loss_normalizer": "all"})


def test_trl_is_made_to_show_our_tool_block_and_a_trl_without_it_is_refused():
    class Trainer:
        _env_tools = {"_GameTools": [bench_trl._GameTools().lookup]}

    specs = ToolUseGameEnv().tool_specs
    trainer = Trainer()
    bench_trl.show_tool_specs(trainer, specs)
    assert trainer._env_tools == {"_GameTools": specs}
    with pytest.raises(SystemExit, match="pins trl"):
        bench_trl.show_tool_specs(object(), specs)
