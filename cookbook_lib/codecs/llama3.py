"""Llama 3.1 / 3.2 / 3.3 JSON tool calls, as their templates write them::

    {"name": "lookup", "parameters": {"key": "a"}}<|eot_id|>

A reply is a tool call when it starts with ``{`` (after whitespace and an optional
``<|python_tag|>``); it must then be exactly one JSON object with ``"name"`` and ``"parameters"``
(``"arguments"`` is read too, as vLLM's parser does). Anything else is a plain answer. The
templates render one call per turn (and drop the content of a turn that calls a tool), so a reply
with more than one call, or text around the call, is a parse failure. Tool results come back in an
``ipython`` turn. Built-in tools (``<|python_tag|>brave_search.call(...)``) are not supported.

Stops: ``<|eot_id|>`` (the turn's closing) and ``<|eom_id|>`` (end of message, which Llama writes
when it expects a tool result). The templates write ``<|eot_id|>`` after a custom tool call, so a
reply that stopped on ``<|eom_id|>`` continues as a restarted sample.
"""

from __future__ import annotations

from collections.abc import Sequence

from cookbook_lib.codecs.reply import (
    ParsedReply,
    ReplyFormat,
    ToolCallFormatError,
    check_name,
    check_reply_length,
    json_type,
    read_call_object,
    read_json,
)
from cookbook_lib.types import ToolSpec

PYTHON_TAG = "<|python_tag|>"


class Llama3JSONFormat(ReplyFormat):
    """One bare JSON object ``{"name": ..., "parameters": {...}}`` as the whole reply."""

    name = "llama3-json"
    families = "Llama 3.1, 3.2, 3.3"
    extra_stops = ("<|eom_id|>",)
    max_calls = 1

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return '{"name": "lookup", "parameters": {' in rendered_call

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            if tagged:
                raise ToolCallFormatError(
                    f"{PYTHON_TAG} is followed by {body[:80]!r}, not a JSON tool call "
                    "(built-in tools are not supported)"
                )
            return ParsedReply(content=body)
        # One object and nothing after it: "extra data" is a reply that is no single call.
        payload = read_json(body, "the tool call")
        # Llama 3 writes "parameters"; "arguments" (the chat APIs' word) is read as well.
        key = "arguments" if isinstance(payload, dict) and "arguments" in payload else "parameters"
        name, arguments = read_call_object(payload, "the tool call", arguments_key=key, name_rule=_tool_name)
        return ParsedReply(content="", calls=[(name, arguments)])


def _tool_name(name: object, where: str) -> str:
    if not isinstance(name, str):
        raise ToolCallFormatError(f'{where}\'s "name" must be a string, got {json_type(name)}')
    return check_name(name, where)
