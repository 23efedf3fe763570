"""The game's own tools: ``list_fact_keys`` and ``lookup``. Both read the episode's :class:`FactBook`.

Bad calls raise; :func:`cookbook_lib.envs.run_tool_calls` turns the exception into a
``tool_error: ...`` message the model sees, and the episode goes on. The errors raised here are
:class:`ToolArgumentError`, which is shown without a Python repr around it, because the message is
written for the model: an unknown key lists the closest keys and points at ``list_fact_keys``.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, ClassVar

from cookbook_lib.envs import ToolArgumentError, ToolResult
from cookbook_lib.envs.tools import shorten
from envs.tool_use_game.facts import FactBook


def format_value(value: int | float) -> str:
    """``17`` for 17 and 17.0 alike, so a copied value is already a clean final answer."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class ListFactKeysTool:
    """Lists every fact key of the episode with its description, one ``key: description`` a line."""

    name = "list_fact_keys"
    description = (
        "List the keys of all facts available in this episode, each with a short description. "
        "Use it to find the key of a fact that the question describes in words."
    )
    parameters_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }

    def __init__(self, book: FactBook) -> None:
        self._book = book

    async def execute(self, arguments: str) -> ToolResult:
        lines = []
        for key in self._book.all_keys():
            fact = self._book.get(key)
            assert fact is not None
            lines.append(f"{key}: {fact.description}" if fact.description else key)
        return ToolResult(content="\n".join(lines) if lines else "no facts in this episode")


class LookupTool:
    """Returns the value of one fact, as a bare number."""

    name = "lookup"
    description = "Look up the value of a fact by its key."
    parameters_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"key": {"type": "string", "description": "the fact key, e.g. apple_count"}},
        "required": ["key"],
    }

    def __init__(self, book: FactBook) -> None:
        self._book = book

    async def execute(self, arguments: str) -> ToolResult:
        # Schema-checked before execute runs, so "key" is present and a string here.
        key = json.loads(arguments)["key"].strip()
        fact = self._book.get(key)
        if fact is None:
            raise ToolArgumentError(self._unknown_key_message(key))
        return ToolResult(content=format_value(fact.value))

    def _unknown_key_message(self, key: str) -> str:
        close = difflib.get_close_matches(key, self._book.all_keys(), n=3, cutoff=0.5)
        hint = f" Close keys: {', '.join(close)}." if close else ""
        return f"unknown fact key {shorten(repr(key))}.{hint} Call list_fact_keys to see every key."
