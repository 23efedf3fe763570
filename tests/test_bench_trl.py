"""bench_trl's TRL side sees the game we train on: the same tools, schemas, results and score."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

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
