"""Gemma 4's native tool calls, as its template writes them::

    <|channel>thought
    reasoning
    <channel|><|tool_call>call:lookup{key:<|"|>a<|"|>,n:3}<tool_call|><|tool_response>

Arguments are Gemma's own notation, not JSON: keys bare, strings between ``<|"|>`` marks (no
escapes inside), numbers, ``true``/``false``/``null``, ``{...}`` and ``[...]``. A reply that calls
tools stops on ``<|tool_response>``; the template then writes the results *inside the same model
turn* and the model goes on writing there (there is no new ``<|turn>model``). A plain answer ends
the turn with ``<turn|>``. Reasoning is a ``<|channel>thought ... <channel|>`` block first.

Parsing is strict and bounded: nesting deeper than :data:`~cookbook_lib.plain_json.MAX_JSON_DEPTH`,
over-long integers and non-finite numbers are failures, as for JSON.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from cookbook_lib.codecs.reply import (
    ParsedReply,
    ReasoningTags,
    ReplyFormat,
    ToolCallFormatError,
    ToolCallTuple,
    check_name,
    check_reply_length,
    join_content,
    split_blocks,
)
from cookbook_lib.plain_json import MAX_INTEGER_DIGITS, MAX_JSON_DEPTH
from cookbook_lib.types import ToolSpec

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
THOUGHT_TAGS = ReasoningTags("<|channel>thought", "<channel|>")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_KEY = re.compile(r"[^:,{}\[\]<>\s]+")


class Gemma4Format(ReplyFormat):
    """``<|tool_call>call:NAME{key:value,...}<tool_call|>`` blocks, ``<|channel>thought`` reasoning."""

    name = "gemma4"
    reasoning_tags = THOUGHT_TAGS
    families = "Gemma 4"
    extra_stops = ("<|tool_response>",)

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return f"{CALL_OPEN}call:lookup{{" in rendered_call

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        reasoning, text = THOUGHT_TAGS.split(text, in_reasoning=in_reasoning)
        pieces, bodies = split_blocks(text, CALL_OPEN, CALL_CLOSE)
        calls = [_read_call(body, number) for number, body in enumerate(bodies, start=1)]
        content = join_content(pieces)
        if QUOTE in content or CALL_OPEN in content:
            raise ToolCallFormatError("tool-call markup outside a <|tool_call> block")
        return ParsedReply(content=content, calls=calls, reasoning=reasoning)


def _read_call(body: str, number: int) -> ToolCallTuple:
    where = f"tool call {number}"
    if not body.startswith("call:"):
        raise ToolCallFormatError(f"{where} must start with call:NAME{{: {body[:80]!r}")
    brace = body.find("{")
    if brace == -1:
        raise ToolCallFormatError(f"{where} has no {{...}} of arguments: {body[:80]!r}")
    name = check_name(body[len("call:") : brace].strip(), where)
    reader = _Reader(body, brace, where=f"{where} ({name})")
    arguments = reader.value(depth=0)
    reader.skip_space()
    if reader.at != len(body):
        raise ToolCallFormatError(
            f"{where} ({name}): unexpected text after the arguments: {body[reader.at :][:80]!r}"
        )
    if not isinstance(arguments, dict):
        raise ToolCallFormatError(f"{where} ({name}): the arguments must be an object")
    return name, arguments


class _Reader:
    """A recursive-descent reader of Gemma's argument notation over ``text`` from ``at``."""

    def __init__(self, text: str, at: int, where: str) -> None:
        self.text, self.at, self.where = text, at, where

    def fail(self, what: str) -> ToolCallFormatError:
        return ToolCallFormatError(
            f"{self.where}: {what} at character {self.at}: {self.text[self.at :][:60]!r}"
        )

    def skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def value(self, depth: int) -> Any:
        if depth > MAX_JSON_DEPTH:
            raise self.fail(f"arguments nested deeper than {MAX_JSON_DEPTH} levels")
        self.skip_space()
        text = self.text
        if text.startswith(QUOTE, self.at):
            end = text.find(QUOTE, self.at + len(QUOTE))
            if end == -1:
                raise self.fail("unclosed string")
            value = text[self.at + len(QUOTE) : end]
            self.at = end + len(QUOTE)
            return value
        for word, constant in (("null", None), ("true", True), ("false", False)):
            if text.startswith(word, self.at):
                self.at += len(word)
                return constant
        if text.startswith("{", self.at):
            return self._object(depth)
        if text.startswith("[", self.at):
            return self._array(depth)
        match = _NUMBER.match(text, self.at)
        if match is None:
            raise self.fail("expected a value")
        self.at = match.end()
        return _number(match.group(0), self)

    def _object(self, depth: int) -> dict[str, Any]:
        self.at += 1
        result: dict[str, Any] = {}
        self.skip_space()
        if self.text.startswith("}", self.at):
            self.at += 1
            return result
        while True:
            self.skip_space()
            key = self._key()
            if key in result:
                raise self.fail(f"key {key!r} given twice")
            self.skip_space()
            if not self.text.startswith(":", self.at):
                raise self.fail("expected ':'")
            self.at += 1
            result[key] = self.value(depth + 1)
            self.skip_space()
            if self.text.startswith(",", self.at):
                self.at += 1
                continue
            if self.text.startswith("}", self.at):
                self.at += 1
                return result
            raise self.fail("expected ',' or '}'")

    def _array(self, depth: int) -> list[Any]:
        self.at += 1
        result: list[Any] = []
        self.skip_space()
        if self.text.startswith("]", self.at):
            self.at += 1
            return result
        while True:
            result.append(self.value(depth + 1))
            self.skip_space()
            if self.text.startswith(",", self.at):
                self.at += 1
                continue
            if self.text.startswith("]", self.at):
                self.at += 1
                return result
            raise self.fail("expected ',' or ']'")

    def _key(self) -> str:
        if self.text.startswith(QUOTE, self.at):
            key = self.value(depth=0)
            assert isinstance(key, str)
            return key
        match = _KEY.match(self.text, self.at)
        if match is None:
            raise self.fail("expected a key")
        self.at = match.end()
        return match.group(0)


def _number(literal: str, reader: _Reader) -> int | float:
    if "." not in literal and "e" not in literal.lower():
        if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
            raise reader.fail(f"an integer of more than {MAX_INTEGER_DIGITS} digits")
        return int(literal)
    if len(literal) > MAX_INTEGER_DIGITS:
        raise reader.fail("an over-long number")
    value = float(literal)
    if not math.isfinite(value):
        raise reader.fail("a number that is not finite")
    return value
