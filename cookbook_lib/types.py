"""Chat data types, dict-shaped as OpenAI-style chat APIs and chat templates use them.

They are ``TypedDict``s, so ``Message(role="user", content="hi")`` builds a plain ``dict`` and
``message.get("tool_calls", [])`` works, exactly as the environment examples use them.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NotRequired, TypedDict

Role = Literal["system", "user", "assistant", "tool"]

DEFAULT_MAX_TOKENS_PER_TURN = 128
"""The sampling budget of one assistant turn when none is given: ``SamplingParams.max_tokens``
(evaluation) and ``GRPOConfig.max_tokens_per_turn`` (training) share it, so an environment sees
the same replies in both. A tool call or a short answer needs far fewer."""


class FunctionCall(TypedDict):
    name: str
    # A JSON-encoded object, as chat APIs send it: tools parse it themselves, so a malformed
    # string reaches the tool and becomes a ``tool_error`` the model sees.
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(TypedDict):
    role: Role
    content: str
    tool_calls: NotRequired[list[ToolCall]]
    # Set on assistant messages whose reply held reasoning (a <think> block, harmony's analysis
    # channel): kept out of ``content``, so an env that scores the answer sees only the answer.
    reasoning_content: NotRequired[str]
    # Set on ``role="tool"`` messages: which call this is the answer to, and the tool's name.
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


class FunctionSpec(TypedDict):
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


class ToolSpec(TypedDict):
    type: Literal["function"]
    function: FunctionSpec


def make_tool_call(call_id: str, name: str, arguments: str | dict[str, Any]) -> ToolCall:
    """Build a :class:`ToolCall`; ``arguments`` given as a dict is JSON-encoded."""
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=call_id, type="function", function=FunctionCall(name=name, arguments=encoded))


__all__ = [
    "DEFAULT_MAX_TOKENS_PER_TURN",
    "FunctionCall",
    "FunctionSpec",
    "Message",
    "Role",
    "ToolCall",
    "ToolSpec",
    "make_tool_call",
]
