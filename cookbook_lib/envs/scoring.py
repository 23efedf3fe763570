"""Small scoring helpers that environments share: reading a number out of a model's reply.

A model's final answer is free text. ``"42"``, ``" 42.0 "`` and ``"42."`` are the same answer and
should score the same; ``"forty-two"`` or ``"42 apples"`` are not a number and score 0, so the
reward teaches the model to answer in the asked-for format.
"""

from __future__ import annotations

import math
import re
from typing import Any

# One number and nothing else: optional sign, digits with an optional fraction (or a bare
# fraction), an optional exponent. Thousands separators, units and words are not accepted.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def parse_number(text: Any) -> float | None:
    """The value of ``text`` when it is exactly one finite number (surrounding spaces allowed).

    Returns ``None`` for anything else: words, several numbers, ``nan``/``inf``, booleans. An
    ``int`` or ``float`` passes through (as a float), so a target stored as a number works too.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        value = float(text)
        return value if math.isfinite(value) else None
    if not isinstance(text, str):
        return None
    stripped = text.strip()
    if not _NUMBER.fullmatch(stripped):
        return None
    try:
        value = float(stripped)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def numbers_match(answer: Any, target: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Whether ``answer`` and ``target`` are the same number, up to float rounding.

    Both go through :func:`parse_number`; either one not being a number means no match. The
    tolerance absorbs the rounding of a float printed and read back (``1/3`` as ``0.333333...``).
    """
    parsed_answer, parsed_target = parse_number(answer), parse_number(target)
    if parsed_answer is None or parsed_target is None:
        return False
    return math.isclose(parsed_answer, parsed_target, rel_tol=rel_tol, abs_tol=abs_tol)


__all__ = ["numbers_match", "parse_number"]
