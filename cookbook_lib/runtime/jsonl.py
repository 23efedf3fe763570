"""Writing JSON lines that any JSON reader takes back, and files that a kill cannot leave half-written.

``jsonable`` makes a value strict JSON (NaN and infinities become null, numpy or 0-d torch scalars
become Python numbers); ``write_atomically`` writes beside the target and swaps the file in with
``os.replace``, so a reader (or a resumed run) sees either the old file or the new one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


class UnrecordableValueError(TypeError):
    """A value JSON cannot hold, even after :func:`jsonable`'s conversions; says where it is."""


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON: NaN and infinities become null (``json.dumps`` would emit a bare
    ``NaN``, which JSON readers reject), numpy or 0-d torch scalars become Python numbers, tuples
    become lists and sets sorted lists (in their repr's order when the items do not compare).
    Anything else is left as it is, for ``json.dumps`` to refuse."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, set | frozenset):
        try:
            ordered = sorted(value)
        except TypeError:
            ordered = sorted(value, key=repr)
        return [jsonable(item) for item in ordered]
    if not isinstance(value, str | int | float | bool | None) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError):  # an array of several values: not a scalar
            return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def check_recordable(value: Any, where: str) -> None:
    """Raise :class:`UnrecordableValueError` naming the first part of ``value`` (``where`` plus its
    keys and indices) that :func:`json_line` could not write."""
    _check_converted(jsonable(value), where)


def _check_converted(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _check_converted(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_converted(item, f"{where}[{index}]")
    elif not isinstance(value, str | int | float | bool | None):
        raise UnrecordableValueError(f"{where} holds a {type(value).__name__} ({repr(value)[:80]})")


def json_line(value: Any, *, fallback: bool = False) -> str:
    """One strict JSON line (with its newline). With ``fallback``, a value JSON cannot hold is
    written as its ``repr`` string instead of raising."""
    return json.dumps(jsonable(value), allow_nan=False, default=repr if fallback else None) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, then ``os.replace`` it in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
