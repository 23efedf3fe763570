"""MathEnv: the smallest useful tool-use environment, a calculator and arithmetic questions.

The model gets a question such as ``What is 37 * (12 + 5)?``, may call the ``calculator`` tool, and
ends the episode by replying with a number; the reward is 1.0 when that number equals the task's
target. The calculator evaluates model output, which is untrusted, so it never uses ``eval``:
:func:`safe_eval` walks a parsed syntax tree that may hold only numbers and arithmetic, and refuses
anything that would take long or produce a huge number before computing it.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from cookbook_lib.envs import Task, ToolArgumentError, ToolEnv, ToolResult
from cookbook_lib.envs.scoring import numbers_match
from cookbook_lib.envs.tools import shorten
from cookbook_lib.types import Message

Number = int | float

# Limits of safe_eval. Each one keeps one kind of input cheap: a long string, a deep tree (the
# evaluator recurses once per level), a power with a huge exponent, an integer with thousands of
# digits (Python's ints are unbounded, so 9**9**9 would run for minutes and fill memory).
MAX_EXPRESSION_LENGTH = 200
MAX_DEPTH = 64
MAX_EXPONENT = 1000
MAX_INT_BITS = 1024  # about 308 decimal digits, roughly the range of a float

_BINARY_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_SYMBOLS: dict[type[ast.AST], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.UAdd: "unary +",
    ast.USub: "unary -",
}
_ALLOWED = "only numbers, + - * / // % **, unary + -, and parentheses are allowed"


def safe_eval(expression: str) -> Number:
    """Evaluate an arithmetic ``expression`` exactly as Python would, or raise ``ValueError``.

    Allowed: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses.
    Refused with a ``ValueError`` saying why: anything else (names, calls, attributes, strings,
    booleans, complex numbers), division by zero, and inputs beyond the limits above. Limits are
    checked before the work they guard, so every call returns within milliseconds.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if not expression.strip():
        raise ValueError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(
            f"the expression is too long ({len(expression)} characters; at most {MAX_EXPRESSION_LENGTH})"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"the expression is not valid arithmetic ({exc.msg})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # e.g. null bytes, absurd nesting
        raise ValueError(f"the expression cannot be parsed ({type(exc).__name__})") from None
    _check_tree(tree.body)
    return _evaluate(tree.body)


def _check_tree(root: ast.expr) -> None:
    """Refuse disallowed syntax and excessive depth before evaluating anything.

    Iterative, so a deep tree is refused here without recursing into it.
    """
    stack: list[tuple[ast.expr, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"the expression is nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, ast.Constant):
            # type(), not isinstance(): bool is a subclass of int and must be refused.
            if type(node.value) not in (int, float):
                raise ValueError(f"{node.value!r} is not a number; {_ALLOWED}")
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY_OPERATORS:
                raise ValueError(f"the operator {type(node.op).__name__} is not allowed; {_ALLOWED}")
            stack += [(node.left, depth + 1), (node.right, depth + 1)]
        elif isinstance(node, ast.UnaryOp):
            if type(node.op) not in _UNARY_OPERATORS:
                raise ValueError(f"the operator {type(node.op).__name__} is not allowed; {_ALLOWED}")
            stack.append((node.operand, depth + 1))
        else:
            raise ValueError(f"{_describe(node)} is not allowed; {_ALLOWED}")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return "attribute access"
    return f"{type(node).__name__} syntax"


def _evaluate(node: ast.expr) -> Number:
    """Evaluate a tree that :func:`_check_tree` accepted; checks every intermediate result."""
    if isinstance(node, ast.Constant):
        return _checked(node.value, "a number in the expression")
    if isinstance(node, ast.UnaryOp):
        return _UNARY_OPERATORS[type(node.op)](_evaluate(node.operand))
    assert isinstance(node, ast.BinOp), "_check_tree lets only Constant, UnaryOp and BinOp through"
    left, right = _evaluate(node.left), _evaluate(node.right)
    op_type = type(node.op)
    symbol = _SYMBOLS[op_type]
    if op_type in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
        raise ValueError(f"division by zero in {_show(left)} {symbol} {_show(right)}")
    if op_type is ast.Pow:
        _check_power(left, right)
    try:
        result = _BINARY_OPERATORS[op_type](left, right)
    except OverflowError:
        raise ValueError(f"the result of {_show(left)} {symbol} {_show(right)} is too large") from None
    except ZeroDivisionError:  # 0.0 ** -1 and the like
        raise ValueError(f"division by zero in {_show(left)} {symbol} {_show(right)}") from None
    if isinstance(result, complex):  # a negative number to a fractional power
        raise ValueError(f"{_show(left)} {symbol} {_show(right)} is not a real number")
    return _checked(result, f"the result of {_show(left)} {symbol} {_show(right)}")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power whose result would be huge, estimating its size without computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(
            f"the exponent {_show(exponent)} is out of range (-{MAX_EXPONENT} to {MAX_EXPONENT})"
        )
    if base == 0 and exponent < 0:
        raise ValueError(f"division by zero in {_show(base)} ** {_show(exponent)}")
    # An int to a non-negative int power is an exact int with about exponent * log2|base| bits;
    # every other combination is a float, whose overflow Python reports and _evaluate refuses.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        bits = exponent * math.log2(abs(base))
        if bits > MAX_INT_BITS:
            raise ValueError(
                f"{_show(base)} ** {_show(exponent)} is too large (about {bits:.0f} bits; "
                f"at most {MAX_INT_BITS})"
            )


def _checked(value: Number, what: str) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is too large for a float")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"{what} is too large (more than {MAX_INT_BITS} bits)")
    return value


def _show(value: Number) -> str:
    """A short rendering of a number for an error message: negatives in parentheses, so that
    ``(-8) ** 0.5`` reads right, and a 300-digit int cut."""
    text = repr(value)
    if len(text) > 24:
        text = f"{text[:10]}...{text[-6:]} ({len(text)} characters)"
    return f"({text})" if value < 0 else text


class CalculatorTool:
    """The ``calculator`` tool: evaluates one arithmetic expression with :func:`safe_eval`."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses, "
        "for example '37 * (12 + 5)'. Returns the result."
    )
    parameters_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "the arithmetic expression to evaluate"}
        },
        "required": ["expression"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        # The environment has already checked the arguments against the schema; parsing them here
        # again keeps the tool usable on its own.
        expression = json.loads(arguments)["expression"]
        try:
            result = safe_eval(expression)
        except ValueError as exc:
            # A ToolArgumentError is shown to the model as "tool_error: <message>", without the
            # exception's repr around it.
            raise ToolArgumentError(f"cannot evaluate {shorten(repr(expression))}: {exc}") from None
        return ToolResult(content=str(result))


SYSTEM_PROMPT = (
    "You solve arithmetic problems. Use the calculator tool to compute the answer, "
    "then reply with only the final number."
)


class MathEnv(ToolEnv):
    """Arithmetic questions with a calculator; reward 1.0 for a final reply equal to the target.

    The final reply is the first assistant message without tool calls. It must be one number and
    nothing else ("42", " 42 ", "42.0" all count for 42; "The answer is 42" scores 0), compared with
    :func:`cookbook_lib.envs.scoring.numbers_match`. Metrics: ``tool_calls`` and ``tool_errors``.
    """

    system_prompt = SYSTEM_PROMPT

    def __init__(self, tool_timeout_s: float | None = 30.0) -> None:
        super().__init__([CalculatorTool()], tool_timeout_s=tool_timeout_s)

    def score(self, task: Task, messages: list[Message]) -> float:
        final = messages[-1]
        if final.get("role") != "assistant" or final.get("tool_calls"):
            return 0.0
        return 1.0 if numbers_match(final.get("content", ""), task.target) else 0.0


DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "math"
SPLITS = ("train", "val")


def load_math_tasks(split: str = "train") -> list[Task]:
    """The bundled arithmetic tasks of ``split`` ("train" or "val"), from ``data/math/``.

    The files are written by ``scripts/make_math_data.py``; train and val share no expression.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = DATA_DIR / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `python scripts/make_math_data.py` to create it")
    with path.open(encoding="utf-8") as file:
        records = [json.loads(line) for line in file if line.strip()]
    return [Task(prompt=r["prompt"], target=r["target"], metadata=r["metadata"]) for r in records]


__all__ = [
    "MAX_DEPTH",
    "MAX_EXPONENT",
    "MAX_EXPRESSION_LENGTH",
    "MAX_INT_BITS",
    "SYSTEM_PROMPT",
    "CalculatorTool",
    "MathEnv",
    "load_math_tasks",
    "safe_eval",
]
