"""Running a message's tool calls safely: every bad call becomes a ``tool_error`` message.

The model's output is untrusted. Malformed JSON, an unknown tool, arguments that break the
tool's JSON schema, an exception or a time-out inside a tool: each is reported back to the model
as a ``role="tool"`` message starting with ``tool_error:`` and the episode goes on.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from cookbook_lib.envs.base import Tool, ToolResult
from cookbook_lib.plain_json import PlainJSONError, loads_plain_json
from cookbook_lib.types import Message, ToolCall

TOOL_ERROR_PREFIX = "tool_error: "


Ending = Literal["stop", "truncate"]


@dataclass
class ToolCallsOutcome:
    """The tool messages produced for one assistant message, and counts for metrics."""

    messages: list[Message] = field(default_factory=list)
    num_calls: int = 0
    num_errors: int = 0
    stop_requested: bool = False  # a tool said should_stop: the episode ends (terminated)
    truncate_requested: bool = False  # a tool said truncate: the episode is cut (truncated)


class ToolArgumentError(ValueError):
    """The arguments of a call do not fit the tool; the message is shown to the model."""


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to about ``limit`` characters, for echoing model output back in an error message
    (a 100k-character argument quoted in full would fill the model's context)."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}...{text[-20:]} ({len(text)} characters)"


def parse_arguments(tool: Tool, arguments: str) -> dict:
    """Decode ``arguments`` and check them against ``tool.parameters_schema``.

    The arguments must be plain JSON (:func:`cookbook_lib.plain_json.loads_plain_json`: no NaN or
    Infinity, bounded nesting and size), so a tool only ever sees values any JSON reader accepts.
    """
    try:
        decoded = loads_plain_json(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise ToolArgumentError(f"arguments of {tool.name} are not valid JSON ({exc.msg})") from None
    except PlainJSONError as exc:
        raise ToolArgumentError(f"arguments of {tool.name} are not plain JSON: {exc}") from None
    if not isinstance(decoded, dict):
        raise ToolArgumentError(
            f"arguments of {tool.name} must be a JSON object, got {type(decoded).__name__}"
        )
    # What jsonschema.validate does, with the validator built once per schema: validate() checks
    # the schema itself on every call, milliseconds that add up over thousands of calls.
    error = jsonschema.exceptions.best_match(_schema_validator(tool.parameters_schema).iter_errors(decoded))
    if error is not None:
        where = shorten("/".join(str(part) for part in error.absolute_path))
        raise ToolArgumentError(
            f"bad arguments for {tool.name}{' at ' + where if where else ''}: {shorten(error.message)}"
        )
    return decoded


def _schema_validator(schema: Mapping[str, Any]) -> Any:
    # Keyed by the schema's JSON text: schemas are mutable dicts, and equal ones can share one.
    return _validator_for_text(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _validator_for_text(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)  # a broken schema raises here, as jsonschema.validate would
    return validator_class(schema)


async def run_tool_call(
    tools: Mapping[str, Tool], call: ToolCall, timeout_s: float | None = None
) -> tuple[Message, bool, Ending | None]:
    """Run one call. Returns (tool message, whether it failed, how the tool asked to end the
    episode: "stop" (``should_stop``), "truncate" (``truncate``) or None)."""
    function = call.get("function") or {}
    name = str(function.get("name", ""))
    call_id = str(call.get("id", ""))
    try:
        tool = tools.get(name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "none"
            raise ToolArgumentError(f"unknown tool {shorten(repr(name))}; available tools: {known}")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # some clients send an already-decoded object
            arguments = json.dumps(arguments)
        parse_arguments(tool, arguments)
        result = await asyncio.wait_for(tool.execute(arguments), timeout_s)
        content, failed, ending = str(result.content), False, _ending(result)
    except ToolArgumentError as exc:
        content, failed, ending = f"{TOOL_ERROR_PREFIX}{exc}", True, None
    except TimeoutError:
        content, failed, ending = f"{TOOL_ERROR_PREFIX}{name} timed out after {timeout_s} s", True, None
    except Exception as exc:  # a tool's own failure is the model's feedback, not a crash
        content, failed, ending = f"{TOOL_ERROR_PREFIX}{shorten(repr(exc), 500)}", True, None
    return Message(role="tool", content=content, tool_call_id=call_id, name=name), failed, ending


def _ending(result: ToolResult) -> Ending | None:
    if bool(getattr(result, "truncate", False)):
        return "truncate"
    return "stop" if bool(result.should_stop) else None


async def run_tool_calls(
    tools: Mapping[str, Tool], message: Message, timeout_s: float | None = None
) -> ToolCallsOutcome:
    """Run every tool call of an assistant ``message`` in order (calls may depend on each other)."""
    outcome = ToolCallsOutcome()
    for call in message.get("tool_calls", []) or []:
        tool_message, failed, ending = await run_tool_call(tools, call, timeout_s)
        outcome.messages.append(tool_message)
        outcome.num_calls += 1
        outcome.num_errors += int(failed)
        outcome.stop_requested |= ending == "stop"
        outcome.truncate_requested |= ending == "truncate"
    return outcome
