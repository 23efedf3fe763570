"""GLM-4.5 / 4.6 tool calls, as their template writes them::

    <think>reasoning</think>
    Optional text.
    <tool_call>lookup
    <arg_key>key</arg_key>
    <arg_value>a</arg_value>
    </tool_call>

Values are text, strings verbatim and anything else as JSON, read back by the tool's schema as for
Qwen3.5's XML form. A GLM turn has no closing token: the model ends its reply by writing the next
turn's opening, ``<|observation|>`` (tool results follow) or ``<|user|>``, so those are the stop
tokens, and the sampled one stands for the first token of what the template writes next.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from cookbook_lib.codecs.reply import (
    THINK_TAGS,
    ParsedReply,
    ReplyFormat,
    ToolCallFormatError,
    ToolCallTuple,
    check_name,
    check_reply_length,
    join_content,
    split_blocks,
    tool_parameters,
    typed_value,
)
from cookbook_lib.types import ToolSpec

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
OBSERVATION, USER = "<|observation|>", "<|user|>"
_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GLMFormat(ReplyFormat):
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``, no turn closing."""

    name = "glm-xml"
    reasoning_tags = THINK_TAGS
    families = "GLM-4.5, GLM-4.6"
    extra_stops = (OBSERVATION, USER)
    stops_open_next_turn = True

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return re.search(r"<tool_call>lookup\s*<arg_key>key</arg_key>", rendered_call) is not None

    def stop_after(self, has_calls: bool) -> str | None:
        return OBSERVATION if has_calls else USER

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        reasoning, text = THINK_TAGS.split(text, in_reasoning=in_reasoning)
        schemas = tool_parameters(tool_specs)
        pieces, bodies = split_blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        calls = [_read_call(body, number, schemas) for number, body in enumerate(bodies, start=1)]
        return ParsedReply(content=join_content(pieces), calls=calls, reasoning=reasoning)


def _read_call(body: str, number: int, schemas: dict[str, Any]) -> ToolCallTuple:
    where = f"tool call {number}"
    name_end = body.find("<arg_key>")
    name_text = body if name_end == -1 else body[:name_end]
    name = check_name(name_text.strip(), where)
    properties = schemas.get(name, {})
    arguments: dict[str, Any] = {}
    position = len(name_text)
    while position < len(body):
        match = _ARGUMENT.match(body, position)
        if match is None:
            rest = body[position:]
            if rest.strip():
                raise ToolCallFormatError(
                    f"{where} ({name}): expected <arg_key>...</arg_key><arg_value>...</arg_value>, "
                    f"got {rest.strip()[:80]!r}"
                )
            break
        key, raw = match.group(1).strip(), match.group(2)
        if not key or "<" in key:
            raise ToolCallFormatError(f"{where} ({name}): {key[:40]!r} is not a parameter name")
        if "<arg_key>" in raw or "<arg_value>" in raw:
            raise ToolCallFormatError(f"{where} ({name}): <arg_value> for {key!r} is not closed")
        if key in arguments:
            raise ToolCallFormatError(f"{where} ({name}): parameter {key!r} is given twice")
        arguments[key] = typed_value(raw, properties.get(key))
        position = match.end()
    return name, arguments
