"""Reading JSON that a model wrote: plain JSON values only, in bounded time, never a crash.

``json.loads`` trusts its input more than model output deserves. On text a small model writes at
temperature 1 it raises ``RecursionError`` (a few hundred nested brackets), ``ValueError`` from
Python's integer-string limit (a 5,000-digit number), and it accepts ``NaN`` and ``Infinity`` (and
turns ``1e999`` into ``inf``), which are not JSON and which a tool or another JSON reader cannot
take. :func:`loads_plain_json` reads the same grammar and refuses each of those with a
:class:`PlainJSONError` saying what was wrong:

- text longer than :data:`MAX_JSON_CHARS` characters (this bounds the time of one call);
- arrays and objects nested more than :data:`MAX_JSON_DEPTH` levels deep;
- integers of more than :data:`MAX_INTEGER_DIGITS` digits (beyond any 64-bit float);
- numbers that are not finite as a 64-bit float: ``NaN``, ``Infinity``, ``-Infinity``, ``1e999``;
- strings (keys included) holding an unpaired UTF-16 surrogate (``"\\ud800"``), which no UTF-8
  file can hold.

Malformed JSON still raises ``json.JSONDecodeError`` (its position is useful to show).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_JSON_CHARS = 200_000
"""Longest JSON text read. Parsing is linear in it; far above any tool call's arguments."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects; tool arguments rarely go past 3 or 4 levels."""
MAX_INTEGER_DIGITS = 300
"""Longest integer literal, in digits. A 64-bit float (all most JSON readers have) ends near 1.8e308."""

# A literal surrogate character, or a \u escape of one (paired ones are fine and checked precisely).
_MAYBE_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
# For measuring nesting on valid JSON text: a string literal, anything but a bracket, an empty pair.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")


class PlainJSONError(ValueError):
    """Valid or nearly valid JSON that is not a plain JSON value this library passes on."""


def loads_plain_json(text: str) -> Any:
    """Decode ``text`` as one plain JSON value, or raise (see the module docstring for the rules).

    Raises ``json.JSONDecodeError`` for malformed JSON and :class:`PlainJSONError` for JSON that
    breaks a rule; both are ``ValueError``. Nothing else escapes for any ``str`` input.
    """
    if not isinstance(text, str):
        raise PlainJSONError(f"JSON text must be a string, got {type(text).__name__}")
    if len(text) > MAX_JSON_CHARS:
        raise PlainJSONError(
            f"the JSON text is {len(text)} characters long; at most {MAX_JSON_CHARS} are read"
        )
    try:
        value = json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant
        )
    except RecursionError:
        # json's C scanner checks the interpreter's recursion limit at each level and unwinds cleanly.
        raise PlainJSONError(f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep") from None
    # Nesting can only exceed the limit if there are more opening brackets than the limit.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nesting_exceeds(text, MAX_JSON_DEPTH):
        raise PlainJSONError(f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep")
    if _MAYBE_SURROGATE.search(text) is not None:
        _check_no_lone_surrogates(value)
    return value


def _parse_int(digits: str) -> int:
    count = len(digits.lstrip("-"))
    if count > MAX_INTEGER_DIGITS:
        raise PlainJSONError(
            f"an integer has {count} digits; at most {MAX_INTEGER_DIGITS} are accepted (beyond that no "
            "64-bit float holds it)"
        )
    return int(digits)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise PlainJSONError(f"the number {_preview(literal)} is out of the range of a 64-bit float")
    return value


def _refuse_constant(name: str) -> float:
    raise PlainJSONError(f"{name} is not JSON (JSON numbers are finite); write a number or null")


def _nesting_exceeds(text: str, limit: int) -> bool:
    """Whether the arrays/objects of ``text``, valid JSON, nest more than ``limit`` levels deep.

    Done on the text with regular expressions (linear, in C) rather than by walking the decoded
    value, which takes a second for 10^5 small arrays: drop the strings, keep the brackets, then
    remove the innermost empty pairs once per level. Valid JSON has balanced brackets, so what is
    left after ``limit`` rounds is nesting deeper than ``limit``.
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(limit):
        brackets = _EMPTY_PAIR.sub("", brackets)
        if not brackets:
            return False
    return bool(brackets)


def _check_no_lone_surrogates(value: Any) -> None:
    # json.loads joins an escaped surrogate pair into one character; what remains unpaired cannot
    # be encoded as UTF-8. The dump is safe: the depth was checked above.
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise PlainJSONError(
            f"a string holds an unpaired UTF-16 surrogate ({bad.encode('unicode_escape').decode()}); "
            "JSON strings must be valid Unicode"
        ) from None


def _preview(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


__all__ = ["MAX_INTEGER_DIGITS", "MAX_JSON_CHARS", "MAX_JSON_DEPTH", "PlainJSONError", "loads_plain_json"]
