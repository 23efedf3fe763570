"""The tool-use game: the cookbook's reference tool-use environment, its bundled tasks and its expert.

``TOOL_USE_GAME_TASKS`` (train) and ``TOOL_USE_GAME_VAL_TASKS`` are loaded from
``data/tool_use_game/`` on first access, not at import: the script that generates those files
imports this package too, and must work before they exist.
"""

from __future__ import annotations

from typing import Any

from envs.tool_use_game.env import SYSTEM_PROMPT, ToolUseGameEnv
from envs.tool_use_game.expert import ToolUseGameExpert, make_tool_use_game_expert, tool_use_game_expert
from envs.tool_use_game.facts import FACT_CATALOG, Fact, FactBook, FactSpec
from envs.tool_use_game.tasks import load_tool_use_game_tasks
from envs.tool_use_game.tools import ListFactKeysTool, LookupTool

_LAZY_SPLITS = {"TOOL_USE_GAME_TASKS": "train", "TOOL_USE_GAME_VAL_TASKS": "val"}


def __getattr__(name: str) -> Any:
    # PEP 562: runs only for names not yet in the module; the tuple is then cached as a global.
    if name in _LAZY_SPLITS:
        tasks = tuple(load_tool_use_game_tasks(_LAZY_SPLITS[name]))
        globals()[name] = tasks
        return tasks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FACT_CATALOG",
    "SYSTEM_PROMPT",
    "TOOL_USE_GAME_TASKS",
    "TOOL_USE_GAME_VAL_TASKS",
    "Fact",
    "FactBook",
    "FactSpec",
    "ListFactKeysTool",
    "LookupTool",
    "ToolUseGameEnv",
    "ToolUseGameExpert",
    "load_tool_use_game_tasks",
    "make_tool_use_game_expert",
    "tool_use_game_expert",
]
