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


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON: NaN and infinities become null (``json.dumps`` would emit a bare
    ``NaN``, which JSON readers reject), and numpy or 0-d torch scalars become Python numbers."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if not isinstance(value, str | int | float | bool | None) and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_line(value: Any) -> str:
    """One strict JSON line (with its newline)."""
    return json.dumps(jsonable(value), allow_nan=False) + "\n"


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
