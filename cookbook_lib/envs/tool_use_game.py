"""The seed page's import path for the reference environment (``envs.tool_use_game`` in this repo's
layout): ``from cookbook_lib.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv`` works
as the page writes it, with the same names, task lists included.
"""

from __future__ import annotations

from typing import Any

import envs.tool_use_game as _game

__all__ = list(_game.__all__)


def __getattr__(name: str) -> Any:
    # Every name is the reference package's; its task lists load on first access (PEP 562).
    if name in __all__:
        return getattr(_game, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
