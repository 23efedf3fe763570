"""The Hermes/Qwen tool-call format, as text: the tools block of a system prompt, the rendering of
an assistant message with tool calls, and the parser that reads a sampled reply back.

A tool call is one JSON object per ``<tool_call>`` block::

    Let me look that up.
    <tool_call>
    {"name": "lookup", "arguments": {"key": "a"}}
    </tool_call>

The renderer writes exactly the form Qwen2.5/Qwen3 templates write (one call per block, the JSON on
one line with ``json.dumps``'s default separators, a newline between content and blocks), and the
parser accepts that form and any whitespace variant of it. The parser is strict about the JSON:
a reply that does not say exactly ``{"name": <string>, "arguments": <object>}`` is a parse failure,
because a lenient parser would reward malformed calls the next tool-calling stack will reject.

A reply is untrusted input, so the parser never raises anything but :class:`ToolCallFormatError`,
whatever the text: the JSON is read by :func:`cookbook_lib.plain_json.loads_plain_json` (bounded
nesting and number size, no ``NaN``/``Infinity``, no unpaired surrogates), and a reply longer than
:data:`~cookbook_lib.codecs.reply.MAX_REPLY_CHARS` is refused before it is scanned, so one parse
takes bounded time.

Nothing here knows about tokens; the codecs in this package add the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cookbook_lib.codecs.reply import (
    ParsedReply,
    ReasoningTags,
    ReplyFormat,
    check_reply_length,
    join_content,
    json_type,
    read_call_object,
    read_json,
    split_blocks,
)
from cookbook_lib.plain_json import PlainJSONError, loads_plain_json
from cookbook_lib.types import Message, ToolCall, ToolSpec

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# The wording follows Qwen2.5's template, which many open models were trained on, plus one line
# saying where results come back (our ChatML rendering puts them in ``tool`` turns).
_TOOLS_INTRO = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>\n\n"
    "The result of each call comes back in a turn with the role tool, in the order of the calls."
)


def tools_system_prompt(tool_specs: Sequence[ToolSpec]) -> str:
    """The block describing ``tool_specs`` that goes at the end of the system message."""
    lines = "".join("\n" + json.dumps(spec, ensure_ascii=False) for spec in tool_specs)
    return _TOOLS_INTRO + lines + _TOOLS_OUTRO


def arguments_object(call: ToolCall) -> dict[str, Any]:
    """The arguments of ``call`` as a dict. Messages carry them JSON-encoded; rendering needs them
    decoded so that every call in a prompt is written the same canonical way."""
    name = call["function"]["name"]
    try:
        arguments = loads_plain_json(call["function"]["arguments"])
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call {name!r}: arguments are not valid JSON ({exc.msg})") from exc
    except PlainJSONError as exc:
        raise ValueError(f"tool call {name!r}: {exc}") from exc
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object, got {json_type(arguments)}")
    return arguments


def format_tool_call(call: ToolCall) -> str:
    """One ``<tool_call>`` block, as the parser reads it and as demonstrations are trained on."""
    payload = {"name": call["function"]["name"], "arguments": arguments_object(call)}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def format_assistant_body(message: Message) -> str:
    """The text of an assistant turn: its content, then one block per tool call, one per line."""
    parts = [message.get("content") or ""]
    parts += [format_tool_call(call) for call in message.get("tool_calls", [])]
    return "\n".join(part for part in parts if part)


def split_reply(text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Split a sampled reply into its content and its tool calls ``(name, arguments)``.

    The content is the text outside the ``<tool_call>`` blocks, each piece stripped, joined by
    newlines. Raises :class:`ToolCallFormatError` for an unclosed or nested block, a stray
    closing tag, a block whose JSON is not exactly ``{"name": ..., "arguments": {...}}`` or not
    plain JSON, and a reply longer than :data:`~cookbook_lib.codecs.reply.MAX_REPLY_CHARS`.
    """
    check_reply_length(text)
    pieces, bodies = split_blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    calls = [_decode_call(body, number=number) for number, body in enumerate(bodies, start=1)]
    return join_content(pieces), calls


def _decode_call(body: str, number: int) -> tuple[str, dict[str, Any]]:
    where = f"tool call {number}"
    return read_call_object(read_json(body, where), where)


class HermesFormat(ReplyFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after the content, and a
    ``<think>`` block first where the template renders reasoning (Qwen3)."""

    name = "hermes-json"
    families = "Qwen2.5, Qwen3, Qwen3-2507, Hermes and other templates writing JSON in <tool_call> blocks"

    def __init__(self, reasoning: ReasoningTags | None = None) -> None:
        self.reasoning_tags = reasoning

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        at = rendered_call.find(TOOL_CALL_OPEN)
        return at != -1 and rendered_call[at + len(TOOL_CALL_OPEN) :].lstrip().startswith("{")

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        reasoning = None
        if self.reasoning_tags is not None:
            reasoning, text = self.reasoning_tags.split(text, in_reasoning=in_reasoning)
        content, calls = split_reply(text)
        return ParsedReply(content=content, calls=calls, reasoning=reasoning)
