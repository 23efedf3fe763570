"""The environment API: ``Env``, ``StepResult``, ``Task``, ``Tool``, ``ToolResult``, ``tool_to_spec``."""

from cookbook_lib.envs.base import Env, StepResult, Task, Tool, ToolResult, tool_to_spec
from cookbook_lib.envs.tool_env import ToolEnv
from cookbook_lib.envs.tools import TOOL_ERROR_PREFIX, ToolArgumentError, ToolCallsOutcome, run_tool_calls

__all__ = [
    "TOOL_ERROR_PREFIX",
    "Env",
    "StepResult",
    "Task",
    "Tool",
    "ToolArgumentError",
    "ToolCallsOutcome",
    "ToolEnv",
    "ToolResult",
    "run_tool_calls",
    "tool_to_spec",
]
