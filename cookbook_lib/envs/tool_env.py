"""A base class for the most common environment shape, so a new env is a prompt, tools and a score.

The shape: a system prompt and the task's prompt open the episode; each assistant message with
tool calls gets their results back; a message without tool calls is the final answer and is
scored; a tool result with ``should_stop=True`` also ends the episode (``terminated=True``). The
episode is cut short instead (``truncated=True``, end cause ``ENV``, reward
``truncation_reward``) by a tool result with ``truncate=True`` or by the env's own rule,
``should_truncate`` (a game's move limit, say).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from cookbook_lib.envs.base import Env, StepResult, Task, Tool, tool_to_spec
from cookbook_lib.envs.tools import run_tool_calls
from cookbook_lib.types import Message, ToolSpec


class ToolEnv(Env):
    """Subclass it, set ``system_prompt``, pass the tools, and implement :meth:`score`."""

    system_prompt: str = ""

    def __init__(self, tools: Sequence[Tool], tool_timeout_s: float | None = 30.0) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self._tools: dict[str, Tool] = {tool.name: tool for tool in tools}
        self._tool_timeout_s = tool_timeout_s
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._tool_calls = 0
        self._tool_errors = 0

    @abc.abstractmethod
    def score(self, task: Task, messages: list[Message]) -> float:
        """The reward of a finished episode, any finite number (GRPO compares rewards within a
        group, so their range is the env's choice); ``messages[-1]`` is what ended it."""

    def should_truncate(self, task: Task, messages: list[Message]) -> bool:
        """Whether the env's own rule cuts the episode after this step's tool results (default
        never). The episode then ends ``truncated`` with :meth:`truncation_reward`."""
        return False

    def truncation_reward(self, task: Task, messages: list[Message]) -> float:
        """The reward of an episode the env cut short (default 0.0)."""
        return 0.0

    @property
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError("call reset(task) before step()")
        return self._task

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._tool_calls = self._tool_errors = 0
        self._messages = [Message(role="user", content=task.prompt)]
        if self.system_prompt:
            self._messages.insert(0, Message(role="system", content=self.system_prompt))
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        task = self.task
        self._messages.append(message)
        if not message.get("tool_calls"):
            return self._finish(task)
        outcome = await run_tool_calls(self._tools, message, self._tool_timeout_s)
        self._messages.extend(outcome.messages)
        self._tool_calls += outcome.num_calls
        self._tool_errors += outcome.num_errors
        if outcome.truncate_requested or self.should_truncate(task, self._messages):
            return StepResult(
                terminated=False,
                truncated=True,
                messages=list(self._messages),
                reward=float(self.truncation_reward(task, self._messages)),
                metrics=self.episode_metrics(),
            )
        if outcome.stop_requested:
            return self._finish(task)
        return StepResult(
            terminated=False,
            truncated=False,
            messages=list(self._messages),
            reward=0.0,
            metrics=self.episode_metrics(),
        )

    def _finish(self, task: Task) -> StepResult:
        reward = float(self.score(task, self._messages))
        return StepResult(
            terminated=True,
            truncated=False,
            messages=list(self._messages),
            reward=reward,
            metrics=self.episode_metrics(),
        )

    def episode_metrics(self) -> dict[str, float]:
        """Diagnostics of the episode so far; the loop keeps those of the last step."""
        return {"tool_calls": float(self._tool_calls), "tool_errors": float(self._tool_errors)}

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)
