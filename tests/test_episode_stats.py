"""bench/episode_stats.py reads both sides' episodes alike, and bench_trl records TRL's."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_trl
import episode_stats

from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks


def _call(name: str, arguments: dict | str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _our_conversation(task, calls: list[dict], answer: str | None) -> list[dict]:
    """An episode played through our env: its messages as our episodes files hold them."""
    env = ToolUseGameEnv()
    messages = asyncio.run(env.reset(task))
    for call in calls:
        arguments = call["function"]["arguments"]
        reply = {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call(call["function"]["name"], json.dumps(arguments))],
        }
        messages = asyncio.run(env.step(reply)).messages
    if answer is not None:
        messages = asyncio.run(env.step({"role": "assistant", "content": answer})).messages
    return messages


def _trl_conversation(task, calls: list[dict], answer: str | None) -> list[dict]:
    """The same episode as TRL's completions hold it: arguments as dicts, errors as {'error': ...}."""
    tools = bench_trl._GameTools()
    tools.reset(facts=json.dumps(task.metadata["facts"]))
    messages: list[dict] = []
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        try:
            result = getattr(tools, name)(**arguments)
        except Exception as error:  # what TRL 1.16's tool loop does with a failing call
            result = {"error": str(error)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


@pytest.fixture
def task():
    return next(t for t in load_tool_use_game_tasks("train") if t.metadata["tier"] == 1)


def test_both_sides_forms_of_one_episode_read_the_same(task):
    key = next(iter(task.metadata["facts"]))
    calls = [_call("lookup", {}), _call("lookup", {"key": "no_such_key"}), _call("lookup", {"key": key})]
    ours = episode_stats.after_prompt(_our_conversation(task, calls, str(task.target)))
    trl = _trl_conversation(task, calls, str(task.target))
    stats = episode_stats.conversation_stats(ours, 1.0, max_turns=6)
    assert stats == episode_stats.conversation_stats(trl, 1.0, max_turns=6)
    assert stats["replies"] == 4 and stats["calls"] == 3
    assert stats["error_share"] == pytest.approx(2 / 3)  # the keyless call and the unknown key
    assert stats["keyless_lookup"] == 1 and stats["answered"] == 1
    assert stats["repeated_call"] == 0 and stats["turn_limit"] == 0


def test_a_loop_to_the_turn_limit_is_counted_as_one(task):
    calls = [_call("lookup", {})] * 6
    stats = episode_stats.conversation_stats(
        episode_stats.after_prompt(_our_conversation(task, calls, None)), 0.0, max_turns=6
    )
    assert stats["repeated_call"] == 1 and stats["turn_limit"] == 1 and stats["answered"] == 0
    assert stats["error_share"] == 1


def test_trls_completions_are_recorded_a_line_a_step_and_tabled(tmp_path, task):
    path = tmp_path / "trl-seed0" / bench_trl.COMPLETIONS_FILE
    score = bench_trl.recorded(bench_trl.game_reward, path)
    assert score.__name__ == "game_reward"
    answered = [{"role": "assistant", "content": str(task.target)}]
    looped = _trl_conversation(task, [_call("lookup", {})] * 6, None)
    assert score([answered, looped], [str(task.target)] * 2) == [1.0, 0.0]
    assert score([looped], [str(task.target)]) == [0.0]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert [episode["reward"] for episode in lines[0]["episodes"]] == [1.0, 0.0]
    table = episode_stats.side_table(episode_stats.trl_episodes(path.parent), max_turns=6)
    assert table[1]["reward"] == 0.5 and table[1]["turn_limit"] == 0.5 and table[1]["n"] == 2
    assert table[2]["repeated_call"] == 1


def test_with_trls_error_text_our_env_shows_a_failed_call_as_trl_does(task, monkeypatch):
    from cookbook_lib.envs import tools

    monkeypatch.setattr(tools, "run_tool_call", tools.run_tool_call)  # put back after the test
    calls = [_call("lookup", {"key": "no_such_key"})]
    before = episode_stats.after_prompt(_our_conversation(task, calls, None))
    assert before[1]["content"].startswith(tools.TOOL_ERROR_PREFIX)
    bench_trl.show_tool_errors_as_trl_does()
    ours = episode_stats.after_prompt(_our_conversation(task, calls, None))
    trl = _trl_conversation(task, calls, None)
    assert ours[1]["content"] == trl[1]["content"] and ours[1]["content"].startswith("{'error': ")
    assert episode_stats.conversation_stats(ours, 0.0, max_turns=6)["error_share"] == 1
