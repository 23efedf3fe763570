"""The environment API: what a user implements to train a tool-use agent.

An :class:`Env` owns the conversation history, tool dispatch and the rule for when an episode
ends. The training loop owns tokenization and sampling. One env object plays one episode: the
loop builds a fresh one per episode from the user's ``env_factory``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from cookbook_lib.types import FunctionSpec, Message, ToolSpec


@dataclass
class Task:
    """The spec of one episode: what the user asks, and what the environment scores against."""

    prompt: str
    target: Any = None
    # Both are recorded with every episode (episodes.jsonl), so they must be JSON values: numpy
    # scalars, tuples and sets are converted; anything else is refused before a run starts.
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResult:
    """What a tool returns, shown to the model as a ``tool`` message.

    ``should_stop=True`` asks the environment to end the episode (``ToolEnv`` then scores it:
    ``terminated``). ``truncate=True`` asks it to cut the episode short instead, as the env's own
    limit (a game's last move, a budget spent): ``ToolEnv`` ends it ``truncated`` (end cause
    ``ENV``) with its ``truncation_reward``.
    """

    content: str
    should_stop: bool = False
    truncate: bool = False


@dataclass
class StepResult:
    """What :meth:`Env.step` returns.

    ``terminated``: task logic ended the episode (a final answer). ``truncated``: it was cut short
    for another reason the environment enforces. The loop reads ``reward`` and ``metrics`` only
    from the step that ends the episode, so put diagnostics in the final step's ``metrics``.
    ``messages`` is the whole conversation, the assistant message just received included (see
    :meth:`Env.step`); ``reward`` any finite number; ``metrics`` names to finite numbers.
    """

    terminated: bool
    truncated: bool
    messages: list[Message]
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """Any object with these members is a tool; no base class is needed."""

    name: str
    description: str
    parameters_schema: dict[str, Any]

    async def execute(self, arguments: str) -> ToolResult: ...


def tool_to_spec(tool: Tool) -> ToolSpec:
    """The schema of ``tool`` that a chat template (or our codec) renders into the prompt."""
    return ToolSpec(
        type="function",
        function=FunctionSpec(
            name=tool.name, description=tool.description, parameters=dict(tool.parameters_schema)
        ),
    )


class Env(abc.ABC):
    """One episode of a tool-use task. Subclass it and implement the four abstract members."""

    @abc.abstractmethod
    async def reset(self, task: Task) -> list[Message]:
        """Start an episode on ``task``; return the opening conversation: a non-empty list of
        messages (system, user, ...), each with a ``role`` and a string ``content``."""

    @abc.abstractmethod
    async def step(self, message: Message) -> StepResult:
        """Take the model's assistant ``message``, run its tool calls, say whether it ended.

        ``StepResult.messages`` is the *whole* conversation: every earlier message unchanged, then
        ``message`` itself, then what the env adds (tool results, a user message): keep a list,
        append to it, return ``list(self._messages)``. ``reward`` is any finite number (its range
        is the env's choice). The rollout checks all of this (:mod:`cookbook_lib.envs.contract`)
        and ends an episode that breaks it as ``ERROR``, saying how to fix it.
        """

    @property
    @abc.abstractmethod
    def tool_specs(self) -> list[ToolSpec]:
        """The tools the model may call in this episode (``tool_to_spec`` of each; [] for none)."""

    @property
    @abc.abstractmethod
    def messages(self) -> list[Message]:
        """The conversation so far (what ``step`` last returned)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Release what ``reset`` started (a subprocess, a connection).

        The loop calls it exactly once whenever an episode ends, on every path: a terminal step,
        every truncation, an exception, or cancellation.
        """
