"""Running a message's tool calls safely: every bad call becomes a ``tool_error`` message.

The model's output is untrusted. Malformed JSON, an unknown tool, arguments that break the
tool's JSON schema, an exception or a time-out inside a tool: each is reported back to the model
as a ``role="tool"`` message starting with ``tool_error:`` and the episode goes on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import jsonschema

from cookbook_lib.envs.base import Tool
from cookbook_lib.types import Message, ToolCall

TOOL_ERROR_PREFIX = "tool_error: "


@dataclass
class ToolCallsOutcome:
    """The tool messages produced for one assistant message, and counts for metrics."""

    messages: list[Message] = field(default_factory=list)
    num_calls: int = 0
    num_errors: int = 0
    stop_requested: bool = False


class ToolArgumentError(ValueError):
    """The arguments of a call do not fit the tool; the message is shown to the model."""


def parse_arguments(tool: Tool, arguments: str) -> dict:
    """Decode ``arguments`` and check them against ``tool.parameters_schema``."""
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise ToolArgumentError(f"arguments of {tool.name} are not valid JSON ({exc.msg})") from None
    if not isinstance(decoded, dict):
        raise ToolArgumentError(
            f"arguments of {tool.name} must be a JSON object, got {type(decoded).__name__}"
        )
    try:
        jsonschema.validate(decoded, tool.parameters_schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        raise ToolArgumentError(
            f"bad arguments for {tool.name}{' at ' + where if where else ''}: {exc.message}"
        ) from None
    return decoded


async def run_tool_call(
    tools: Mapping[str, Tool], call: ToolCall, timeout_s: float | None = None
) -> tuple[Message, bool, bool]:
    """Run one call. Returns (tool message, whether it failed, whether the tool asked to stop)."""
    function = call.get("function") or {}
    name = str(function.get("name", ""))
    call_id = str(call.get("id", ""))
    try:
        tool = tools.get(name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "none"
            raise ToolArgumentError(f"unknown tool {name!r}; available tools: {known}")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # some clients send an already-decoded object
            arguments = json.dumps(arguments)
        parse_arguments(tool, arguments)
        result = await asyncio.wait_for(tool.execute(arguments), timeout_s)
        content, failed, stop = str(result.content), False, bool(result.should_stop)
    except ToolArgumentError as exc:
        content, failed, stop = f"{TOOL_ERROR_PREFIX}{exc}", True, False
    except TimeoutError:
        content, failed, stop = f"{TOOL_ERROR_PREFIX}{name} timed out after {timeout_s} s", True, False
    except Exception as exc:  # a tool's own failure is the model's feedback, not a crash
        content, failed, stop = f"{TOOL_ERROR_PREFIX}{exc!r}", True, False
    return Message(role="tool", content=content, tool_call_id=call_id, name=name), failed, stop


async def run_tool_calls(
    tools: Mapping[str, Tool], message: Message, timeout_s: float | None = None
) -> ToolCallsOutcome:
    """Run every tool call of an assistant ``message`` in order (calls may depend on each other)."""
    outcome = ToolCallsOutcome()
    for call in message.get("tool_calls", []) or []:
        tool_message, failed, stop = await run_tool_call(tools, call, timeout_s)
        outcome.messages.append(tool_message)
        outcome.num_calls += 1
        outcome.num_errors += int(failed)
        outcome.stop_requested |= stop
    return outcome
