"""``ToolUseGameEnv``: the cookbook's reference tool-use environment.

Each task hides a few numeric facts behind three tools. ``list_fact_keys`` lists the facts of the
episode with a short description of each, ``lookup`` returns the value of one fact by key, and
``calculator`` evaluates arithmetic. The question asks for one fact, or for arithmetic over one or
two facts, naming the fact keys (tiers 1 and 2) or describing the facts in words (tier 3).

Scoring rule
------------
The episode ends when the model replies without a tool call. That final reply is compared
numerically with ``task.target`` by :func:`cookbook_lib.envs.scoring.numbers_match`: after stripping
spaces, ``"42"``, ``"42.0"`` and ``" 42 "`` all match a target of 42, while ``"41"``,
``"forty-two"``, ``"42 apples"`` or an empty reply do not. The reward is 1.0 for a match and 0.0
otherwise, so it always lies in [0, 1]. An episode ended by a tool asking to stop
(``should_stop=True``) has no final reply and scores 0.0.

Metrics of every episode (from the last step): ``tool_calls`` and ``tool_errors`` (all calls, and
those that came back as ``tool_error``), ``lookups`` and ``calculator_calls`` (calls of those
tools, failed ones included), ``used_list_keys`` (1.0 when ``list_fact_keys`` was called) and
``answered`` (1.0 once a final reply without tool calls was given).
"""

from __future__ import annotations

from collections.abc import Sequence

from cookbook_lib.envs import Task, Tool, ToolEnv
from cookbook_lib.envs.scoring import numbers_match
from cookbook_lib.types import Message
from envs.math_env import CalculatorTool
from envs.tool_use_game.facts import FactBook
from envs.tool_use_game.tools import ListFactKeysTool, LookupTool

SYSTEM_PROMPT = (
    "Answer the question using the tools. lookup returns the value of a fact by its key; if the "
    "question does not name a key, call list_fact_keys first to find it. Use calculator for "
    "arithmetic. When you know the answer, reply with only the final number."
)


class ToolUseGameEnv(ToolEnv):
    """Facts behind ``list_fact_keys`` and ``lookup``, plus a ``calculator``; scored on the final number.

    ``extra_tools`` are offered next to the three game tools, for example a tool that ends the
    episode early by returning ``should_stop=True``.
    """

    system_prompt = SYSTEM_PROMPT

    def __init__(self, extra_tools: Sequence[Tool] = (), tool_timeout_s: float | None = 30.0) -> None:
        self._book = FactBook()
        tools: list[Tool] = [ListFactKeysTool(self._book), LookupTool(self._book), CalculatorTool()]
        super().__init__([*tools, *extra_tools], tool_timeout_s=tool_timeout_s)

    async def reset(self, task: Task) -> list[Message]:
        facts = task.metadata.get("facts")
        if not isinstance(facts, dict) or not facts:
            raise ValueError(
                "a tool-use game task needs task.metadata['facts']: {key: {'value', 'description'}}"
            )
        self._book.load(facts)
        return await super().reset(task)

    def score(self, task: Task, messages: list[Message]) -> float:
        final = messages[-1]
        if final["role"] != "assistant" or final.get("tool_calls"):
            return 0.0  # ended by a tool's should_stop: there is no final answer to score
        return 1.0 if numbers_match(final.get("content", ""), task.target) else 0.0

    def episode_metrics(self) -> dict[str, float]:
        names = [
            call.get("function", {}).get("name", "")
            for message in self._messages
            if message["role"] == "assistant"
            for call in message.get("tool_calls") or []
        ]
        last = self._messages[-1] if self._messages else None
        answered = last is not None and last["role"] == "assistant" and not last.get("tool_calls")
        return {
            **super().episode_metrics(),
            "lookups": float(names.count("lookup")),
            "calculator_calls": float(names.count("calculator")),
            "used_list_keys": float("list_fact_keys" in names),
            "answered": float(answered),
        }
