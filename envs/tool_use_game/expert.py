"""A scripted expert for the tool-use game: it proves every task solvable and writes SFT demonstrations.

The expert knows the *plan* of a task from ``task.metadata`` (which keys to look up, which
arithmetic to do) but never its answer: every value it uses comes from the tool results in the
conversation, and the final answer is the calculator's result (or the looked-up value). A broken
tool or a wrong fact therefore makes the expert fail instead of being papered over by the target.

It is stateless: the next move is derived from the messages alone (the number of assistant turns
so far and the tool results), so one policy object can play any number of episodes of its task.
Traces make one tool call per assistant message (list_fact_keys on tier 3, lookups, calculator),
then the bare number. Small seeded variations (lookup order, spacing in the expression) keep the
demonstrations from all looking alike.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Callable
from typing import Any

from cookbook_lib.envs import TOOL_ERROR_PREFIX, Task
from cookbook_lib.envs.scoring import parse_number
from cookbook_lib.types import Message, ToolSpec, make_tool_call
from envs.tool_use_game.tasks import load_tool_use_game_tasks
from envs.tool_use_game.tools import format_value

ExpertPolicy = Callable[[list[Message], list[ToolSpec]], Message]


class ToolUseGameExpert:
    """The scripted policy for one task. Build it with :func:`make_tool_use_game_expert`."""

    def __init__(self, task: Task, seed: int | None = None) -> None:
        metadata = task.metadata
        self._keys: list[str] = list(metadata["keys"])
        self._expression: str = metadata["expression"]
        # Same task, same trace: the variations are seeded by the prompt unless a seed is given.
        rng = random.Random(seed if seed is not None else zlib.crc32(task.prompt.encode("utf-8")))
        lookup_order = list(self._keys)
        if len(lookup_order) > 1 and rng.random() < 0.3:
            lookup_order.reverse()
        self._compact_expression = rng.random() < 0.3  # "17-5" rather than "17 - 5"
        # A question in words (tier 3), or one that does not spell out every key, starts by listing.
        needs_listing = metadata.get("tier") == 3 or any(key not in task.prompt for key in self._keys)
        self._plan: list[tuple[str, dict[str, Any]]] = [("list_fact_keys", {})] if needs_listing else []
        self._plan += [("lookup", {"key": key}) for key in lookup_order]
        if self._expression != f"{{{self._keys[0]}}}":  # anything but a bare fact needs arithmetic
            self._plan.append(("calculator", {}))  # its expression is filled in from the lookups

    def __call__(self, messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
        turn = sum(1 for message in messages if message["role"] == "assistant")
        results = self._tool_results(messages)
        if turn < len(self._plan):
            name, arguments = self._plan[turn]
            if name == "calculator":
                arguments = {"expression": self._calculator_expression(results)}
            call = make_tool_call(_call_id(turn), name, arguments)
            return Message(role="assistant", content="", tool_calls=[call])
        if turn == len(self._plan):
            return Message(role="assistant", content=self._answer(results))
        raise RuntimeError("the expert already gave its final answer; the episode should have ended")

    def _tool_results(self, messages: list[Message]) -> dict[str, str]:
        """Content of each tool message by call id; a failed call is a bug of the task or the env."""
        results: dict[str, str] = {}
        for message in messages:
            if message["role"] != "tool":
                continue
            content = message["content"]
            if content.startswith(TOOL_ERROR_PREFIX):
                raise RuntimeError(f"the expert's call {message.get('name')!r} failed: {content}")
            results[message.get("tool_call_id", "")] = content
        return results

    def _result_of(self, name: str, results: dict[str, str], key: str | None = None) -> str:
        for turn, (planned, arguments) in enumerate(self._plan):
            if planned == name and (key is None or arguments.get("key") == key):
                if _call_id(turn) not in results:
                    raise RuntimeError(f"no result for the expert's {name} call {_call_id(turn)}")
                return results[_call_id(turn)]
        raise RuntimeError(f"the expert's plan has no {name} call" + (f" for {key!r}" if key else ""))

    def _value(self, results: dict[str, str], key: str) -> str:
        if self._plan[0][0] == "list_fact_keys":
            listing = self._result_of("list_fact_keys", results)
            if not any(line.split(":", 1)[0].strip() == key for line in listing.splitlines()):
                raise RuntimeError(f"list_fact_keys does not list {key!r}: {listing!r}")
        return _clean_number(self._result_of("lookup", results, key), f"lookup of {key!r}")

    def _calculator_expression(self, results: dict[str, str]) -> str:
        expression = self._expression.format(**{key: self._value(results, key) for key in self._keys})
        return expression.replace(" ", "") if self._compact_expression else expression

    def _answer(self, results: dict[str, str]) -> str:
        if self._plan[-1][0] == "calculator":
            return _clean_number(self._result_of("calculator", results), "calculator result")
        return self._value(results, self._keys[0])


def _call_id(turn: int) -> str:
    return f"call_{turn}"


def _clean_number(text: str, what: str) -> str:
    """A tool's numeric output as the answer a model should give: "12" for "12" or "12.0"."""
    value = parse_number(text)
    if value is None:
        raise RuntimeError(f"the {what} is not a number: {text!r}")
    return format_value(value)


def make_tool_use_game_expert(task: Task, seed: int | None = None) -> ExpertPolicy:
    """The expert policy for ``task`` (any task with ``metadata`` keys, expression and tier)."""
    return ToolUseGameExpert(task, seed=seed)


@functools.lru_cache(maxsize=1)
def _bundled_tasks_by_prompt() -> dict[str, Task]:
    # Prompts are unique across the splits (the generator guarantees it), so a prompt names a task.
    return {task.prompt: task for split in ("train", "val") for task in load_tool_use_game_tasks(split)}


def tool_use_game_expert(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
    """The expert as a plain policy for the bundled tasks: it finds its task by the user's prompt.

    For a task of your own, use ``make_tool_use_game_expert(task)``.
    """
    prompt = next((message["content"] for message in messages if message["role"] == "user"), None)
    task = _bundled_tasks_by_prompt().get(prompt) if prompt is not None else None
    if task is None:
        raise ValueError(
            f"not a bundled tool-use game task: {prompt!r}; use make_tool_use_game_expert(task) instead"
        )
    return make_tool_use_game_expert(task)(messages, tool_specs)
