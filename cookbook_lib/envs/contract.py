"""The environment contract, checked: what :class:`~cookbook_lib.envs.base.Env`'s members must return,
and what a :class:`~cookbook_lib.envs.base.Task` must hold, with a message that names the env's class,
the member and the fix when they do not.

The rollout checks every ``reset`` and ``step`` it gets (:func:`reset_problem`, :func:`step_problem`):
a breach ends that episode as ``ERROR`` with the message, not a confusing failure three calls later
inside the library. ``evaluate`` and ``train_multi_turn`` check their tasks before any model loads
(:func:`check_tasks`). The contract, in one place (also in the README):

- ``reset(task)`` returns the opening conversation: a non-empty list of messages, each a dict
  with a ``role`` ("system", "user", "assistant" or "tool") and a string ``content``;
- ``step(message)`` returns a :class:`~cookbook_lib.envs.base.StepResult` whose ``messages`` is the
  *whole* conversation: everything before, unchanged, then the assistant ``message`` it was given,
  then whatever the env adds (tool results, a user message). The conversation only grows;
- ``reward`` is a finite number, in whatever range the env chooses (the group-relative advantage
  only compares rewards); ``terminated`` and ``truncated`` are bools; ``metrics`` maps names to
  finite numbers;
- ``tool_specs`` is a list of tool specs (``tool_to_spec`` makes one), the same through an episode;
- a task's ``target`` and ``metadata`` are recorded with every episode (``episodes.jsonl``), so
  they must be JSON values after the conversions :func:`cookbook_lib.runtime.jsonl.jsonable` makes
  (numpy scalars become numbers, tuples and sets become lists, NaN becomes null, dict keys
  become strings).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.runtime.jsonl import UnrecordableValueError, check_recordable
from cookbook_lib.types import Message

ROLES = ("system", "user", "assistant", "tool")


class EnvContractError(TypeError):
    """An env returned something the contract does not allow; the message says what and the fix."""


def reset_problem(env: Env, messages: object) -> str | None:
    """Why what ``env.reset`` returned breaks the contract, or None."""
    name = f"{type(env).__name__}.reset"
    if not isinstance(messages, list):
        return f"{name} returned {type(messages).__name__}; return the opening messages as a list"
    if not messages:
        return f"{name} returned no messages; return at least the user's message with the task's prompt"
    return _messages_problem(name, "returned", messages)


def step_problem(env: Env, before: Sequence[Message], sent: Message, result: object) -> str | None:
    """Why what ``env.step(sent)`` returned breaks the contract, or None; ``before`` is the
    conversation the model was shown."""
    name = f"{type(env).__name__}.step"
    if not isinstance(result, StepResult):
        kind = type(result).__name__
        return f"{name} returned {kind}; return a StepResult(terminated, truncated, messages, ...)"
    for field in ("terminated", "truncated"):
        if not isinstance(getattr(result, field), bool):
            return f"{name} returned {field}={getattr(result, field)!r}; it must be True or False"
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(float(reward)):
        return f"{name} returned reward={reward!r}; return a finite number (any range the env likes)"
    if not isinstance(result.metrics, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(float(v))
        for k, v in result.metrics.items()
    ):
        return f"{name} returned metrics={result.metrics!r}; return a dict of names to finite numbers"
    messages = result.messages
    if not isinstance(messages, list):
        return (
            f"{name} returned messages as {type(messages).__name__}; return the whole conversation as a list"
        )
    problem = _messages_problem(name, "returned in messages", messages)
    if problem is not None:
        return problem
    expected = len(before) + 1
    if len(messages) < expected:
        return (
            f"{name} returned {len(messages)} message{'s' if len(messages) != 1 else ''}, fewer than "
            f"the {expected} of the conversation so far with the assistant message; return the whole "
            "conversation, the assistant message and what follows it included, as `list(self._messages)`"
        )
    for index, (got, want) in enumerate(zip(messages, before, strict=False)):
        if got != want:
            return (
                f"{name} changed messages[{index}] (a {want['role']} message before this step); the "
                "conversation only grows: return earlier messages unchanged, then the new ones"
            )
    if messages[len(before)] != sent:
        got = messages[len(before)]
        return (
            f"{name} returned messages[{len(before)}] = a {got.get('role')} message where the assistant "
            "message it was given belongs; append the assistant message to the conversation first, "
            "then the tool results"
        )
    return None


def _messages_problem(name: str, verb: str, messages: Sequence[object]) -> str | None:
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"{name} {verb} item {index} as {type(message).__name__}; each message is a dict (Message)"
        role = message.get("role")
        if role not in ROLES:
            return f"{name} {verb} message {index} with role {role!r}; the roles are {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            content = repr(message.get("content"))[:60]
            return f"{name} {verb} message {index} ({role}) with content {content}; content is a string"
    return None


def check_tasks(tasks: Sequence[Any], what: str = "tasks") -> None:
    """Refuse, before anything loads, a task that could not be played or recorded: not a
    :class:`Task`, a prompt that is not a string, or a target or metadata JSON cannot hold.
    The message names the task's index and the key."""
    for index, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise TypeError(f"{what}[{index}] is {type(task).__name__}, not a Task(prompt, target, metadata)")
        if not isinstance(task.prompt, str):
            raise TypeError(f"{what}[{index}].prompt is {type(task.prompt).__name__}; a prompt is a string")
        if not isinstance(task.metadata, Mapping):
            raise TypeError(f"{what}[{index}].metadata is {type(task.metadata).__name__}; it is a dict")
        for field, value in (("target", task.target), ("metadata", task.metadata)):
            try:
                check_recordable(value, f"{what}[{index}].{field}")
            except UnrecordableValueError as exc:
                raise ValueError(
                    f"{exc}, which episodes.jsonl cannot record; store it as a JSON value (a string, "
                    "number, bool, None, list or dict with string keys)"
                ) from None
