"""MathEnv: the expert solves every bundled task; bad tool calls become tool_errors; data is reproducible."""

from __future__ import annotations

import asyncio
import filecmp
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cookbook_lib.envs import TOOL_ERROR_PREFIX, Task, Tool
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.rollout.play import Policy, run_episode
from cookbook_lib.types import Message, ToolSpec, make_tool_call
from envs.experts import math_expert
from envs.math_env import DATA_DIR, SYSTEM_PROMPT, CalculatorTool, MathEnv, load_math_tasks, safe_eval

REPO = Path(__file__).resolve().parent.parent
TASK = Task(prompt="What is 37 * (12 + 5)?", target=629, metadata={"expression": "37 * (12 + 5)", "level": 2})


def play(policy: Policy, task: Task = TASK, max_turns: int = 4) -> Episode:
    return asyncio.run(run_episode(lambda _task: MathEnv(), task, policy, max_turns=max_turns))


def scripted(*replies: Message) -> Policy:
    """A policy that plays ``replies`` in order, whatever it is shown."""
    moves: Iterator[Message] = iter(replies)

    def policy(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
        return next(moves)

    return policy


def call(name: str, arguments: str | dict) -> Message:
    return Message(role="assistant", content="", tool_calls=[make_tool_call("call_0", name, arguments)])


def answer(text: str) -> Message:
    return Message(role="assistant", content=text)


@pytest.mark.parametrize("split", ["train", "val"])
def test_expert_solves_every_bundled_task(split: str) -> None:
    async def play_all() -> list[Episode]:
        return [
            await run_episode(lambda _task: MathEnv(), task, math_expert, max_turns=4)
            for task in load_math_tasks(split)
        ]

    episodes = asyncio.run(play_all())
    failed = [(e.task.prompt, e.end_cause, e.messages[-1]) for e in episodes if e.reward != 1.0]
    assert not failed
    for episode in episodes:
        assert episode.end_cause is EndCause.TERMINATED
        assert episode.num_turns == 2
        assert episode.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}


def test_expert_reads_the_tool_result_not_the_target() -> None:
    # A wrong target: the expert still answers what the calculator said, so it scores 0.
    episode = play(math_expert, Task(prompt="What is 2 + 2?", target=5))
    assert episode.messages[-1] == answer("4")
    assert episode.reward == 0.0


def test_an_episode_looks_like_the_seed_describes() -> None:
    episode = play(math_expert)
    roles = [m["role"] for m in episode.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert episode.messages[0]["content"] == SYSTEM_PROMPT
    tool_message = episode.messages[3]
    assert tool_message == Message(role="tool", content="629", tool_call_id="call_0", name="calculator")


@pytest.mark.parametrize(
    ("final", "reward"),
    [("629", 1.0), (" 629 ", 1.0), ("629.0", 1.0), ("630", 0.0), ("The answer is 629", 0.0), ("", 0.0)],
)
def test_score_compares_numbers(final: str, reward: float) -> None:
    episode = play(scripted(answer(final)))
    assert episode.end_cause is EndCause.TERMINATED
    assert episode.reward == reward


@pytest.mark.parametrize(
    ("bad_call", "hint"),
    [
        (call("calculator", '{"expression": "1 +'), "not valid JSON"),
        (call("calculator", "[1, 2]"), "must be a JSON object"),
        (call("calc", {"expression": "1 + 1"}), "unknown tool 'calc'; available tools: calculator"),
        (call("calculator", {}), "'expression' is a required property"),
        (call("calculator", {"expr": "1 + 1"}), "'expression' is a required property"),
        (call("calculator", {"expression": 629}), "629 is not of type 'string'"),
        (call("calculator", {"expression": "9**9**9"}), "cannot evaluate '9**9**9': the exponent"),
        (call("calculator", {"expression": "__import__('os')"}), "function call is not allowed"),
        (call("calculator", {"expression": "1 / 0"}), "division by zero"),
    ],
)
def test_bad_tool_calls_become_tool_errors_and_the_episode_goes_on(bad_call: Message, hint: str) -> None:
    episode = play(scripted(bad_call, call("calculator", {"expression": "37 * (12 + 5)"}), answer("629")))
    error = episode.messages[3]
    assert error["role"] == "tool"
    assert error["content"].startswith(TOOL_ERROR_PREFIX)
    assert hint in error["content"]
    assert error["tool_call_id"] == "call_0"
    assert episode.messages[5]["content"] == "629"  # the retry worked
    assert episode.end_cause is EndCause.TERMINATED
    assert episode.reward == 1.0
    assert episode.metrics == {"tool_calls": 2.0, "tool_errors": 1.0}


def test_several_calls_in_one_message_each_get_an_answer() -> None:
    calls = [
        make_tool_call("call_0", "calculator", {"expression": "37 * 17"}),
        make_tool_call("call_1", "calculator", {"expression": "x"}),
    ]
    episode = play(scripted(Message(role="assistant", content="", tool_calls=calls), answer("629")))
    first, second = episode.messages[3:5]
    assert (first["tool_call_id"], first["content"]) == ("call_0", "629")
    assert second["tool_call_id"] == "call_1"
    assert second["content"].startswith(TOOL_ERROR_PREFIX)
    assert episode.metrics == {"tool_calls": 2.0, "tool_errors": 1.0}


def test_max_turns_truncates_an_agent_that_never_answers() -> None:
    def keeps_calling(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
        return call("calculator", {"expression": "1 + 1"})

    episode = play(keeps_calling, max_turns=3)
    assert episode.end_cause is EndCause.MAX_TURNS
    assert episode.truncated
    assert episode.num_turns == 3
    assert episode.reward == 0.0
    assert episode.metrics["tool_calls"] == 3.0
    assert sum(m["role"] == "tool" for m in episode.messages) == 3


def test_tool_specs_and_the_calculator_on_its_own() -> None:
    env = MathEnv()
    (spec,) = env.tool_specs
    assert spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]
    tool = CalculatorTool()
    assert isinstance(tool, Tool)
    result = asyncio.run(tool.execute(json.dumps({"expression": "(14 + 26) / 2"})))
    assert result.content == "20.0"
    assert not result.should_stop


def test_step_before_reset_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        asyncio.run(MathEnv().step(answer("1")))


def test_bundled_tasks_are_consistent() -> None:
    train, val = load_math_tasks("train"), load_math_tasks("val")
    assert (len(train), len(val)) == (200, 50)
    assert not {t.prompt for t in train} & {t.prompt for t in val}
    assert len({t.prompt for t in train}) == len(train)
    for task in train + val:
        expression = task.metadata["expression"]
        assert task.prompt == f"What is {expression}?"
        assert task.target == safe_eval(expression)
        assert task.metadata["level"] in (1, 2, 3)
    assert {t.metadata["level"] for t in train} == {1, 2, 3}


def test_load_math_tasks_refuses_an_unknown_split() -> None:
    with pytest.raises(ValueError, match="split"):
        load_math_tasks("test")


def test_regenerating_the_data_is_byte_identical(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_math_data.py"), "--out-dir", str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    for name in ("train.jsonl", "val.jsonl"):
        assert filecmp.cmp(tmp_path / name, DATA_DIR / name, shallow=False), name
