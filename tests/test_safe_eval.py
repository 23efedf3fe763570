"""safe_eval: Python's arithmetic on allowed input, a ValueError (fast) on everything else.

Python's own ``eval`` appears here only as the test oracle, on expressions this file generates.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.math_env import MAX_DEPTH, MAX_EXPRESSION_LENGTH, safe_eval

TIME_LIMIT_S = 0.5  # generous: a refusal takes microseconds, the machine running CI may be busy
OPERATORS = ["+", "-", "*", "/", "//", "%", "**"]
REFUSAL_REASONS = (
    "division by zero",
    "too large",
    "out of range",
    "not a real number",
    "too long",
    "nested too deeply",
)


def python_value(expression: str) -> Any:
    """The oracle: Python's own arithmetic on a test-generated expression, with no builtins."""
    return eval(expression, {"__builtins__": {}}, {})


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    return function(), time.perf_counter() - started


def evaluate_or_refuse(expression: str) -> tuple[Any, ValueError | None]:
    """(result, None) or (None, the ValueError); any other exception propagates and fails."""
    try:
        value, elapsed = timed(lambda: safe_eval(expression))
    except ValueError as exc:
        return None, exc
    assert elapsed < TIME_LIMIT_S, f"safe_eval({expression!r}) took {elapsed:.3f} s"
    return value, None


def tree_depth(expression: str) -> int:
    def depth(node: ast.AST) -> int:
        children = [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)]
        return 1 + max((depth(child) for child in children), default=0)

    return depth(ast.parse(expression, mode="eval").body)


leaves = st.one_of(
    st.integers(0, 1000).map(str),
    st.integers(0, 10_000).map(lambda n: repr(n / 100)),  # floats such as 12.34, 0.0, 100.0
)


def _extend(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    binary = st.tuples(children, st.sampled_from(OPERATORS), children)
    return st.one_of(
        binary.map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        binary.map(lambda t: f"{t[0]} {t[1]} {t[2]}"),  # Python's precedence decides the tree
        st.tuples(st.sampled_from("+-"), children).map(lambda t: f"{t[0]}{t[1]}"),
        st.tuples(st.sampled_from("+-"), children).map(lambda t: f"{t[0]}({t[1]})"),
    )


expressions = st.recursive(leaves, _extend, max_leaves=12)


@settings(max_examples=600, deadline=None)
@given(expressions)
def test_matches_python_arithmetic_or_refuses(expression: str) -> None:
    started = time.perf_counter()
    result, refusal = evaluate_or_refuse(expression)
    assert time.perf_counter() - started < TIME_LIMIT_S
    if refusal is None:
        expected = python_value(expression)  # safe to run: safe_eval just did the same operations
        assert type(result) is type(expected)
        assert repr(result) == repr(expected)  # exact, including the sign of a float zero
        return
    message = str(refusal)
    assert any(reason in message for reason in REFUSAL_REASONS), message
    if "too long" in message:
        assert len(expression) > MAX_EXPRESSION_LENGTH
    elif "nested too deeply" in message:
        assert tree_depth(expression) > MAX_DEPTH
    elif "**" not in expression:
        # Without powers, a dozen numbers up to 1000 cannot grow large, so the only reason left
        # to refuse is a division by zero, which Python refuses too.
        assert "division by zero" in message
        with pytest.raises(ZeroDivisionError):
            python_value(expression)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=250), st.text(alphabet="0123456789.+-*/%() eEjx_", max_size=250)))
def test_any_text_gives_a_number_or_a_value_error_quickly(text: str) -> None:
    started = time.perf_counter()
    result, refusal = evaluate_or_refuse(text)
    assert time.perf_counter() - started < TIME_LIMIT_S
    assert refusal is not None or type(result) in (int, float)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("37 * (12 + 5)", 629),
        ("7 / 2", 3.5),
        ("8 / 2", 4.0),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("7.5 % -2", -0.5),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("2 ** 0.5", 2**0.5),
        ("-2 ** 2", -4),
        ("(-2) ** 2", 4),
        ("+-+3", -3),
        ("  1 + 1  ", 2),
        ("1_000 + 0x10", 1016),
        ("2 ** 1000 // 2 ** 999", 2),
        ("10 ** -400", 0.0),
        ("1e308", 1e308),
    ],
)
def test_examples(expression: str, expected: int | float) -> None:
    result = safe_eval(expression)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("9**9**9", "exponent 387420489 is out of range"),
        ("10**1000000", "out of range"),
        ("(10**100)**100", "too large"),
        ("2**1000 * 2**1000", "too large"),
        ("999 ** 999", "too large"),
        ("2.5 ** 1000", "too large"),
        ("1e308 * 10", "too large for a float"),
        ("1e999", "too large for a float"),
        ("1e300 // 1e-300", "too large"),
        ("(-8) ** (1 / 3)", "not a real number"),
        ("1 / 0", "division by zero"),
        ("1 // 0.0", "division by zero"),
        ("5 % (3 - 3)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("0.0 ** -2.5", "division by zero"),
        ("", "empty"),
        ("   ", "empty"),
        ("(" * 1000 + "1" + ")" * 1000, "too long"),
        ("1 + " * 100 + "1", "too long"),
        ("-" * 100 + "1", "nested too deeply"),
        ("(" * 70 + "1" + " + 1)" * 70, "too long"),
        ("x", "name 'x'"),
        ("__import__('os').system('true')", "function call"),
        ("abs(-1)", "function call"),
        ("(1).real", "attribute access"),
        ("lambda: 1", "Lambda"),
        ("'1' + '1'", "not a number"),
        ("True + 1", "not a number"),
        ("1j * 1j", "not a number"),
        ("None", "not a number"),
        ("[1, 2]", "List"),
        ("1 if 1 else 2", "IfExp"),
        ("1 < 2", "Compare"),
        ("~1", "Invert"),
        ("not 1", "Not"),
        ("1 << 10", "LShift"),
        ("1 & 1", "BitAnd"),
        ("1 +", "not valid arithmetic"),
        ("1; 2", "not valid arithmetic"),
        ("x = 1", "not valid arithmetic"),
        ("1\x00", "null bytes"),
    ],
)
def test_refusals_say_why(expression: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        safe_eval(expression)
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    "expression", ["9**9**9", "10**1000000", "(10**100)**100", "(" * 1000 + "1" + ")" * 1000]
)
def test_huge_inputs_are_refused_fast(expression: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ValueError):
        safe_eval(expression)
    assert time.perf_counter() - started < TIME_LIMIT_S


def test_nesting_within_the_limit_works() -> None:
    assert safe_eval("(" * 60 + "1" + ")" * 60) == 1
    assert safe_eval("-" * 63 + "1") == -1


@pytest.mark.parametrize("value", [None, 42, b"1+1", ["1"]])
def test_non_string_input_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="must be a string"):
        safe_eval(value)  # type: ignore[arg-type]
