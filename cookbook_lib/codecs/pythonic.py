"""LFM2 / LFM2.5's pythonic tool calls, as their templates write them::

    <think>reasoning</think>Text.<|tool_call_start|>[lookup(key='a', n=3), lookup(key='b')]<|tool_call_end|>

The list is read with Python's own parser (``ast.parse``), never evaluated: it must be a list of
calls of plain names with keyword arguments only, and every argument a literal (strings, numbers,
``True``/``False``/``None`` and their JSON spellings ``true``/``false``/``null``, lists, tuples,
dicts with string keys; the template writes objects as JSON and other values as Python literals).
Anything else (a positional argument, an expression, an attribute call) is a parse failure.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from typing import Any

from cookbook_lib.codecs.reply import (
    THINK_TAGS,
    ParsedReply,
    ReplyFormat,
    ToolCallFormatError,
    ToolCallTuple,
    check_reply_length,
    join_content,
    split_blocks,
)
from cookbook_lib.plain_json import MAX_INTEGER_DIGITS, MAX_JSON_DEPTH
from cookbook_lib.types import ToolSpec

CALLS_OPEN, CALLS_CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
_NAMED_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class PythonicFormat(ReplyFormat):
    """``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``."""

    name = "pythonic"
    families = "LFM2, LFM2.5"

    def __init__(self, reasoning: bool = True) -> None:
        self.reasoning_tags = THINK_TAGS if reasoning else None

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return f"{CALLS_OPEN}[lookup(key=" in rendered_call

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        reasoning = None
        if self.reasoning_tags is not None:
            reasoning, text = self.reasoning_tags.split(text, in_reasoning=in_reasoning)
        pieces, bodies = split_blocks(text, CALLS_OPEN, CALLS_CLOSE)
        calls: list[ToolCallTuple] = []
        for body in bodies:
            calls += _read_calls(body, first_number=len(calls) + 1)
        return ParsedReply(content=join_content(pieces), calls=calls, reasoning=reasoning)


def _read_calls(body: str, first_number: int) -> list[ToolCallTuple]:
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolCallFormatError(
            f"the tool calls are not a Python list of calls ({type(exc).__name__}): {body[:200]!r}"
        ) from None
    if not isinstance(tree.body, ast.List):
        raise ToolCallFormatError(f"the tool calls must be a list [name(key=value), ...]: {body[:200]!r}")
    calls: list[ToolCallTuple] = []
    for number, node in enumerate(tree.body.elts, start=first_number):
        where = f"tool call {number}"
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ToolCallFormatError(f"{where} is not a call of a plain tool name")
        name = node.func.id
        if node.args:
            raise ToolCallFormatError(f"{where} ({name}) passes positional arguments; use key=value")
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise ToolCallFormatError(f"{where} ({name}) unpacks **arguments")
            arguments[keyword.arg] = _literal(keyword.value, depth=0, where=f"{where} ({name})")
        calls.append((name, arguments))
    return calls


def _literal(node: ast.expr, depth: int, where: str) -> Any:
    """The value of a literal node; anything that is not a literal is a parse failure."""
    if depth > MAX_JSON_DEPTH:
        raise ToolCallFormatError(f"{where}: arguments nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return _checked_number(node.value, where)
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
    ):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _checked_number(-value, where)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, depth + 1, where) for item in node.elts]
    if isinstance(node, ast.Dict):
        result: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise ToolCallFormatError(f"{where}: a dict key that is not a string")
            result[key.value] = _literal(value, depth + 1, where)
        return result
    raise ToolCallFormatError(f"{where}: {type(node).__name__} is not a literal value")


def _checked_number(value: Any, where: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    # bit_length, not str(): str() of a huge int raises past Python's 4,300-digit conversion limit.
    if isinstance(value, int) and abs(value).bit_length() > MAX_INTEGER_DIGITS * 3.33:
        raise ToolCallFormatError(f"{where}: an integer of more than {MAX_INTEGER_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolCallFormatError(f"{where}: a number that is not finite")
    return value
