"""The tool-use game: bundled tasks, the expert on every one of them, scoring, bad tool calls, end paths."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from cookbook_lib.envs import TOOL_ERROR_PREFIX, Task, Tool, ToolResult
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.rollout.play import Policy, run_episode
from cookbook_lib.types import Message, ToolCall, ToolSpec, make_tool_call
from envs.tool_use_game import (
    TOOL_USE_GAME_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
    load_tool_use_game_tasks,
    make_tool_use_game_expert,
    tool_use_game_expert,
)
from envs.tool_use_game.facts import FACTS_BY_KEY
from envs.tool_use_game.tasks import DATA_DIR

REPO = Path(__file__).resolve().parents[1]
ALL_TASKS = (*TOOL_USE_GAME_TASKS, *TOOL_USE_GAME_VAL_TASKS)

TASK = Task(
    prompt="What is apple_count plus pear_count?",
    target=42,
    metadata={
        "tier": 2,
        "keys": ["apple_count", "pear_count"],
        "expression": "{apple_count} + {pear_count}",
        "facts": {
            "apple_count": {"value": 17, "description": "number of apples in the orchard"},
            "pear_count": {"value": 25, "description": "number of pears in the basket"},
            "plum_count": {"value": 3, "description": "number of plums on the table"},
        },
    },
)


def play(task: Task, policy: Policy, max_turns: int = 8, extra_tools: Sequence[Tool] = ()) -> Episode:
    return asyncio.run(
        run_episode(lambda _: ToolUseGameEnv(extra_tools=extra_tools), task, policy, max_turns=max_turns)
    )


def scripted(*replies: Message) -> Policy:
    """A policy that plays ``replies`` in order, one per assistant turn."""

    def policy(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
        turn = sum(message["role"] == "assistant" for message in messages)
        return replies[turn]

    return policy


def calls(*tool_calls: ToolCall) -> Message:
    return Message(role="assistant", content="", tool_calls=list(tool_calls))


def answer(text: str) -> Message:
    return Message(role="assistant", content=text)


def tool_messages(episode: Episode) -> list[Message]:
    return [message for message in episode.messages if message["role"] == "tool"]


# --- the expert on the bundled tasks ---------------------------------------------------------------


async def _play_all(tasks: Sequence[Task], policy_for: Any) -> list[Episode]:
    return [
        await run_episode(lambda _: ToolUseGameEnv(), task, policy_for(task), max_turns=6) for task in tasks
    ]


@pytest.mark.parametrize("split", ["train", "val"])
def test_expert_solves_every_bundled_task(split: str) -> None:
    tasks = TOOL_USE_GAME_TASKS if split == "train" else TOOL_USE_GAME_VAL_TASKS
    # The plain policy finds its task by prompt; the factory is given it. Both must solve everything.
    for policy_for in (lambda task: tool_use_game_expert, make_tool_use_game_expert):
        episodes = asyncio.run(_play_all(tasks, policy_for))
        for task, episode in zip(tasks, episodes, strict=True):
            assert episode.end_cause is EndCause.TERMINATED, (task.prompt, episode.error)
            assert episode.reward == 1.0, (task.prompt, episode.messages[-1])
            metrics = episode.metrics
            assert metrics["tool_errors"] == 0
            assert metrics["lookups"] == len(task.metadata["keys"])
            assert metrics["used_list_keys"] == float(task.metadata["tier"] == 3)
            assert metrics["answered"] == 1.0
            # One tool call per assistant message, then a bare number.
            assistant = [m for m in episode.messages if m["role"] == "assistant"]
            assert all(len(m["tool_calls"]) == 1 for m in assistant[:-1])
            assert re.fullmatch(r"-?\d+", assistant[-1]["content"])


def test_expert_takes_values_from_the_tools_not_from_the_target() -> None:
    # Other fact values: the expert's answer follows them. A wrong target: the expert does not match it.
    moved = json.loads(json.dumps(TASK.metadata))
    moved["facts"]["apple_count"]["value"] = 100
    episode = play(dataclasses.replace(TASK, metadata=moved), make_tool_use_game_expert(TASK))
    assert episode.messages[-1]["content"] == "125"
    episode = play(dataclasses.replace(TASK, target=43), make_tool_use_game_expert(TASK))
    assert episode.messages[-1]["content"] == "42"
    assert episode.reward == 0.0


def test_expert_traces_vary() -> None:
    # Seeded variations: lookups in both orders and both spacings of the calculator expression.
    expressions = []
    first_lookup_is_first_key = []
    for task in TOOL_USE_GAME_TASKS:
        episode = play(task, make_tool_use_game_expert(task))
        for message in episode.messages:
            for call in message.get("tool_calls", []):
                arguments = json.loads(call["function"]["arguments"])
                expressions += [arguments["expression"]] if "expression" in arguments else []
        lookups = [
            json.loads(call["function"]["arguments"])["key"]
            for message in episode.messages
            for call in message.get("tool_calls", [])
            if call["function"]["name"] == "lookup"
        ]
        if len(lookups) == 2:
            first_lookup_is_first_key.append(lookups[0] == task.metadata["keys"][0])
    assert {" " in expression for expression in expressions} == {True, False}
    assert set(first_lookup_is_first_key) == {True, False}


def test_plain_expert_refuses_a_task_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="make_tool_use_game_expert"):
        play(TASK, tool_use_game_expert)


# --- scoring ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("42", 1.0),
        ("42.0", 1.0),
        (" 42 ", 1.0),
        ("41", 0.0),
        ("forty-two", 0.0),
        ("", 0.0),
        ("42 apples", 0.0),
    ],
)
def test_final_reply_is_compared_as_a_number(reply: str, reward: float) -> None:
    episode = play(TASK, scripted(answer(reply)))
    assert episode.end_cause is EndCause.TERMINATED
    assert episode.reward == reward


# --- tools -----------------------------------------------------------------------------------------


def test_tools_and_their_specs() -> None:
    specs = {spec["function"]["name"]: spec["function"] for spec in ToolUseGameEnv().tool_specs}
    assert list(specs) == ["list_fact_keys", "lookup", "calculator"]
    assert specs["lookup"]["parameters"]["required"] == ["key"]
    assert specs["list_fact_keys"]["parameters"]["properties"] == {}


def test_list_lookup_and_calculator_work() -> None:
    episode = play(
        TASK,
        scripted(
            calls(make_tool_call("call_0", "list_fact_keys", {})),
            calls(make_tool_call("call_1", "lookup", {"key": " apple_count "})),
            calls(make_tool_call("call_2", "calculator", {"expression": "17 + 25"})),
            answer("42"),
        ),
    )
    listing, value, result = (message["content"] for message in tool_messages(episode))
    assert listing.splitlines() == [
        "apple_count: number of apples in the orchard",
        "pear_count: number of pears in the basket",
        "plum_count: number of plums on the table",
    ]
    assert value == "17"
    assert result == "42"
    assert [m["tool_call_id"] for m in tool_messages(episode)] == ["call_0", "call_1", "call_2"]
    assert episode.reward == 1.0


BAD_CALLS = {
    "unknown key": (make_tool_call("c", "lookup", {"key": "apple_cnt"}), "Close keys: apple_count"),
    "missing key": (make_tool_call("c", "lookup", {}), "'key' is a required property"),
    "wrong type": (make_tool_call("c", "lookup", {"key": 5}), "not of type 'string'"),
    "malformed JSON": (make_tool_call("c", "lookup", '{"key": "apple_count"'), "not valid JSON"),
    "unknown tool": (make_tool_call("c", "search", {"query": "apples"}), "unknown tool 'search'"),
    "arguments to list_fact_keys": (make_tool_call("c", "list_fact_keys", {"x": 1}), "list_fact_keys"),
    "bad expression": (make_tool_call("c", "calculator", {"expression": "17 +"}), "cannot evaluate"),
    "calculator without expression": (make_tool_call("c", "calculator", {}), "'expression'"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_tool_call_becomes_a_tool_error_and_the_episode_goes_on(case: str) -> None:
    call, expected = BAD_CALLS[case]
    episode = play(TASK, scripted(calls(call), answer("42")))
    (error,) = tool_messages(episode)
    assert error["content"].startswith(TOOL_ERROR_PREFIX)
    assert expected in error["content"]
    assert episode.end_cause is EndCause.TERMINATED
    assert episode.reward == 1.0
    assert episode.metrics["tool_errors"] == 1.0
    assert episode.metrics["tool_calls"] == 1.0


def test_metrics_count_every_kind_of_call() -> None:
    episode = play(
        TASK,
        scripted(
            calls(make_tool_call("call_0", "list_fact_keys", {})),
            calls(  # two lookups in one message, one of them failing
                make_tool_call("call_1", "lookup", {"key": "apple_count"}),
                make_tool_call("call_2", "lookup", {"key": "nope"}),
            ),
            calls(make_tool_call("call_3", "calculator", {"expression": "17 + 25"})),
            calls(make_tool_call("call_4", "search", {})),
            answer("42"),
        ),
    )
    assert episode.metrics == {
        "tool_calls": 5.0,
        "tool_errors": 2.0,
        "lookups": 2.0,
        "calculator_calls": 1.0,
        "used_list_keys": 1.0,
        "answered": 1.0,
    }


class GiveUpTool:
    name = "give_up"
    description = "Stop the episode."
    parameters_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content="stopped", should_stop=True)


def test_should_stop_ends_the_episode_as_terminated_without_an_answer() -> None:
    policy = scripted(
        calls(make_tool_call("call_0", "lookup", {"key": "apple_count"})),
        calls(make_tool_call("call_1", "give_up", {})),
        answer("42"),  # never asked for
    )
    episode = play(TASK, policy, extra_tools=[GiveUpTool()])
    assert episode.end_cause is EndCause.TERMINATED
    assert episode.num_turns == 2
    assert episode.messages[-1]["content"] == "stopped"
    assert episode.reward == 0.0
    assert episode.metrics["answered"] == 0.0


def test_max_turns_truncates() -> None:
    lookup_forever = scripted(
        *[calls(make_tool_call(f"call_{i}", "lookup", {"key": "apple_count"})) for i in range(9)]
    )
    episode = play(TASK, lookup_forever, max_turns=3)
    assert episode.end_cause is EndCause.MAX_TURNS
    assert episode.num_turns == 3
    assert episode.reward == 0.0
    assert episode.metrics["lookups"] == 3.0
    assert episode.metrics["answered"] == 0.0


def test_a_task_without_facts_is_refused_at_reset() -> None:
    episode = play(Task(prompt="What is x?", target=1), scripted(answer("1")))
    assert episode.end_cause is EndCause.ERROR
    assert "metadata['facts']" in (episode.error or "")


# --- the bundled data ------------------------------------------------------------------------------


def test_splits_are_disjoint_and_cover_every_tier() -> None:
    assert len(TOOL_USE_GAME_TASKS) == 300
    assert len(TOOL_USE_GAME_VAL_TASKS) == 60
    train_prompts = {task.prompt for task in TOOL_USE_GAME_TASKS}
    val_prompts = {task.prompt for task in TOOL_USE_GAME_VAL_TASKS}
    assert len(train_prompts) == 300 and len(val_prompts) == 60
    assert not train_prompts & val_prompts
    for tasks in (TOOL_USE_GAME_TASKS, TOOL_USE_GAME_VAL_TASKS):
        assert set(Counter(task.metadata["tier"] for task in tasks)) == {1, 2, 3}


def test_every_task_is_well_formed() -> None:
    for task in ALL_TASKS:
        metadata = task.metadata
        facts, keys = metadata["facts"], metadata["keys"]
        assert 3 <= len(facts) <= 6, task.prompt
        assert set(keys) < set(facts), f"no distractor in {task.prompt!r}"
        assert isinstance(task.target, int) and task.target >= 0, task.prompt
        if metadata["tier"] in (1, 2):
            assert all(key in task.prompt for key in keys), task.prompt
        else:  # every look-alike of a needed fact is listed too: the key is chosen by its description
            for key in keys:
                family = [
                    spec.key for spec in FACTS_BY_KEY.values() if spec.family == FACTS_BY_KEY[key].family
                ]
                assert set(family) <= set(facts), task.prompt


def test_phrasings_vary_within_every_tier() -> None:
    for tier in (1, 2, 3):
        shapes = set()
        for task in TOOL_USE_GAME_TASKS:
            if task.metadata["tier"] == tier:
                shape = task.prompt
                for key in task.metadata["facts"]:
                    shape = shape.replace(key, "K")
                for fact in task.metadata["facts"].values():
                    shape = shape.replace(fact["description"], "D")
                shapes.add(re.sub(r"\d+", "N", shape))
        assert len(shapes) >= 8, (tier, shapes)


def test_fact_values_differ_between_tasks() -> None:
    values: dict[str, set[int]] = {}
    for task in TOOL_USE_GAME_TASKS:
        for key, fact in task.metadata["facts"].items():
            values.setdefault(key, set()).add(fact["value"])
    assert all(len(seen) > 3 for seen in values.values())


def test_loader_rejects_an_unknown_split() -> None:
    with pytest.raises(ValueError, match="split"):
        load_tool_use_game_tasks("test")


def test_regenerating_the_data_is_byte_identical(tmp_path: Path) -> None:
    # The script itself, run in-process (a subprocess would pay for importing torch again).
    spec = importlib.util.spec_from_file_location(
        "make_data", REPO / "scripts" / "make_tool_use_game_data.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out-dir", str(tmp_path / "again")])
    for split in ("train", "val"):
        assert (tmp_path / "again" / f"{split}.jsonl").read_bytes() == (
            DATA_DIR / f"{split}.jsonl"
        ).read_bytes()
    script.main(["--out-dir", str(tmp_path / "other"), "--seed", "7"])
    assert (tmp_path / "other" / "train.jsonl").read_bytes() != (DATA_DIR / "train.jsonl").read_bytes()
