"""The XML tool-call form of Qwen3.5, Qwen3.6, Qwen3.8 (and Nemotron 3), as their templates write it::

    <think>
    reasoning
    </think>

    Optional text.

    <tool_call>
    <function=lookup>
    <parameter=key>
    a
    </parameter>
    </function>
    </tool_call>

A parameter's value is text: the template writes a string as it is and anything else as JSON, so
the parser reads it back by the tool's JSON schema (:func:`~cookbook_lib.codecs.reply.typed_value`).
One newline after ``<parameter=...>`` and one before ``</parameter>`` belong to the markup.

Strict: a ``<tool_call>`` block holds exactly one ``<function=NAME>...</function>``, which holds
only ``<parameter=KEY>...</parameter>`` blocks and whitespace; anything else is a parse failure.
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

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]*)>")
_PARAMETER_CLOSE = "</parameter>"


class QwenXMLFormat(ReplyFormat):
    """``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``."""

    name = "qwen-xml"
    families = "Qwen3.5, Qwen3.6, Qwen3.8, Nemotron 3"

    def __init__(self, reasoning: bool = True) -> None:
        self.reasoning_tags = THINK_TAGS if reasoning else None

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return re.search(r"<tool_call>\s*<function=lookup>\s*<parameter=key>", rendered_call) is not None

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        reasoning = None
        if self.reasoning_tags is not None:
            reasoning, text = self.reasoning_tags.split(text, in_reasoning=in_reasoning)
        schemas = tool_parameters(tool_specs)
        pieces, bodies = split_blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        calls = [_read_call(body, number, schemas) for number, body in enumerate(bodies, start=1)]
        return ParsedReply(content=join_content(pieces), calls=calls, reasoning=reasoning)


def _read_call(body: str, number: int, schemas: dict[str, Any]) -> ToolCallTuple:
    where = f"tool call {number}"
    match = _FUNCTION.fullmatch(body)
    if match is None:
        raise ToolCallFormatError(
            f"{where} must hold exactly one <function=NAME>...</function> block: {body.strip()[:200]!r}"
        )
    name = check_name(match.group(1).strip(), where)
    properties = schemas.get(name, {})
    inner = match.group(2)
    if "<function=" in inner or "</function>" in inner:
        raise ToolCallFormatError(f"{where} ({name}) holds more than one <function=...> block")
    arguments: dict[str, Any] = {}
    position = 0
    while True:
        opening = _PARAMETER_OPEN.search(inner, position)
        between = inner[position : opening.start() if opening else len(inner)]
        if between.strip():
            raise ToolCallFormatError(
                f"{where} ({name}): text outside <parameter=...> blocks: {between.strip()[:80]!r}"
            )
        if opening is None:
            break
        key = opening.group(1).strip()
        if not key:
            raise ToolCallFormatError(f"{where} ({name}): a <parameter=> without a name")
        end = inner.find(_PARAMETER_CLOSE, opening.end())
        if end == -1:
            raise ToolCallFormatError(f"{where} ({name}): <parameter={key}> is not closed")
        raw = inner[opening.end() : end]
        if _PARAMETER_OPEN.search(raw):
            raise ToolCallFormatError(
                f"{where} ({name}): <parameter={key}> is not closed before the next one"
            )
        if key in arguments:
            raise ToolCallFormatError(f"{where} ({name}): parameter {key!r} is given twice")
        raw = raw.removeprefix("\n").removesuffix("\n")
        arguments[key] = typed_value(raw, properties.get(key))
        position = end + len(_PARAMETER_CLOSE)
    return name, arguments
