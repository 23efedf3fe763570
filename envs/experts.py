"""Scripted expert policies: they solve every bundled task of an environment, without a model.

They prove the bundled tasks are solvable through the tools the model gets, and later provide
warm-start demonstrations. Like any policy they see only the conversation and the tool specs
(never the task's target): an expert that peeked at the target would prove nothing.
"""

from __future__ import annotations

import re

from cookbook_lib.types import Message, ToolSpec, make_tool_call

# The bundled math prompts read "What is <expression>?".
_MATH_QUESTION = re.compile(r"^\s*What is (?P<expression>.+?)\?\s*$", re.DOTALL)


def math_expert(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
    """The MathEnv expert: call ``calculator`` with the question's expression, then answer with
    the tool's result.

    Turn 1 (no tool result yet): one ``calculator`` call on the expression parsed out of the user's
    question. Turn 2: reply with the content of the calculator's answer. If that answer is a
    ``tool_error``, the expert still replies with it rather than retrying forever; the reply is not
    a number, so it scores 0 and the failure is visible.
    """
    last = messages[-1]
    if last["role"] == "tool":
        return Message(role="assistant", content=last["content"])
    question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    match = _MATH_QUESTION.match(question)
    expression = match.group("expression") if match else question.strip()
    num_calls = sum(len(m.get("tool_calls", [])) for m in messages)
    call = make_tool_call(f"call_{num_calls}", "calculator", {"expression": expression})
    return Message(role="assistant", content="", tool_calls=[call])


__all__ = ["math_expert"]


# The tool-use game's expert lives with the game; re-exported so both experts are found here.
from envs.tool_use_game import make_tool_use_game_expert, tool_use_game_expert  # noqa: E402

__all__ = ["make_tool_use_game_expert", "math_expert", "tool_use_game_expert"]
