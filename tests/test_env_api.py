"""The public environment API: names, shapes and behaviour the seed page relies on."""

from __future__ import annotations

import asyncio
import json

from cookbook_lib.envs import Env, StepResult, Task, Tool, ToolEnv, ToolResult, run_tool_calls, tool_to_spec
from cookbook_lib.types import Message, ToolCall, make_tool_call


class AddTool:
    name = "add"
    description = "Add two integers."
    parameters_schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        args = json.loads(arguments)
        return ToolResult(content=str(args["a"] + args["b"]))


class BrokenTool:
    name = "broken"
    description = "Always fails."
    parameters_schema = {"type": "object", "properties": {}}

    async def execute(self, arguments: str) -> ToolResult:
        raise RuntimeError("disk on fire")


class SlowTool:
    name = "slow"
    description = "Takes too long."
    parameters_schema = {"type": "object", "properties": {}}

    async def execute(self, arguments: str) -> ToolResult:
        await asyncio.sleep(10)
        return ToolResult(content="late")


def test_messages_are_plain_dicts_as_the_seed_uses_them():
    message = Message(
        role="assistant", content="", tool_calls=[make_tool_call("c1", "add", {"a": 1, "b": 2})]
    )
    assert isinstance(message, dict)
    call: ToolCall = message.get("tool_calls", [])[0]
    assert call["id"] == "c1"
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert Message(role="user", content="hi").get("tool_calls", []) == []


def test_task_and_results_have_the_seed_fields():
    task = Task(prompt="2+2?", target=4)
    assert task.metadata == {}
    assert ToolResult(content="x").should_stop is False
    step = StepResult(terminated=True, truncated=False, messages=[], reward=1.0)
    assert step.metrics == {}


def test_tool_protocol_and_spec():
    tool = AddTool()
    assert isinstance(tool, Tool)
    assert not isinstance(object(), Tool)
    spec = tool_to_spec(tool)
    assert spec == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": AddTool.parameters_schema,
        },
    }
    # The spec is a copy: editing it does not change the tool.
    spec["function"]["parameters"]["x"] = 1
    assert "x" not in AddTool.parameters_schema


def test_env_is_abstract():
    class Incomplete(Env):
        async def reset(self, task):
            return []

    try:
        Incomplete()
    except TypeError as exc:
        assert "step" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("an Env without step() must not instantiate")


def _calls_message(*calls: ToolCall) -> Message:
    return Message(role="assistant", content="", tool_calls=list(calls))


def test_run_tool_calls_reports_every_bad_call_as_tool_error():
    tools = {"add": AddTool(), "broken": BrokenTool()}
    message = _calls_message(
        make_tool_call("1", "add", {"a": 1, "b": 2}),
        make_tool_call("2", "add", "{not json"),
        make_tool_call("3", "add", {"a": 1}),
        make_tool_call("4", "add", {"a": "one", "b": 2}),
        make_tool_call("5", "nope", {}),
        make_tool_call("6", "broken", {}),
        make_tool_call("7", "add", "[1, 2]"),
    )
    outcome = asyncio.run(run_tool_calls(tools, message))
    contents = [m["content"] for m in outcome.messages]
    assert contents[0] == "3"
    assert contents[1].startswith("tool_error: arguments of add are not valid JSON")
    assert contents[2].startswith("tool_error: bad arguments for add") and "'b' is a required" in contents[2]
    assert contents[3].startswith("tool_error: bad arguments for add at a") and "integer" in contents[3]
    assert contents[4] == "tool_error: unknown tool 'nope'; available tools: add, broken"
    assert contents[5].startswith("tool_error: RuntimeError") and "disk on fire" in contents[5]
    assert contents[6].startswith("tool_error: arguments of add must be a JSON object")
    assert (outcome.num_calls, outcome.num_errors) == (7, 6)
    assert [m["tool_call_id"] for m in outcome.messages] == [str(i) for i in range(1, 8)]
    assert all(m["role"] == "tool" for m in outcome.messages)


def test_a_tool_that_hangs_times_out_as_tool_error():
    message = _calls_message(make_tool_call("1", "slow", {}))
    outcome = asyncio.run(run_tool_calls({"slow": SlowTool()}, message, timeout_s=0.05))
    assert outcome.messages[0]["content"] == "tool_error: slow timed out after 0.05 s"


class StopTool:
    name = "submit"
    description = "Submit and end."
    parameters_schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content=json.loads(arguments)["answer"], should_stop=True)


class SubmitEnv(ToolEnv):
    system_prompt = "Submit the answer."

    def score(self, task: Task, messages: list[Message]) -> float:
        return float(messages[-1]["content"] == task.target)


def test_tool_env_ends_on_should_stop_with_terminated():
    async def play() -> StepResult:
        env = SubmitEnv([StopTool(), AddTool()])
        opening = await env.reset(Task(prompt="say ok", target="ok"))
        assert [m["role"] for m in opening] == ["system", "user"]
        assert [spec["function"]["name"] for spec in env.tool_specs] == ["submit", "add"]
        return await env.step(_calls_message(make_tool_call("1", "submit", {"answer": "ok"})))

    result = asyncio.run(play())
    assert result.terminated and not result.truncated
    assert result.reward == 1.0
    assert result.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}


def test_tool_env_rejects_duplicate_tool_names_and_step_before_reset():
    try:
        SubmitEnv([AddTool(), AddTool()])
    except ValueError as exc:
        assert "unique" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("duplicate tool names must be refused")
    env = SubmitEnv([AddTool()])
    try:
        asyncio.run(env.step(Message(role="assistant", content="x")))
    except RuntimeError as exc:
        assert "reset" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("step before reset must fail clearly")
