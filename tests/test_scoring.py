"""cookbook_lib.envs.scoring: reading one number out of a reply, and comparing it with a target."""

from __future__ import annotations

import pytest

from cookbook_lib.envs.scoring import numbers_match, parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42.0),
        (" 42 ", 42.0),
        ("42.0", 42.0),
        ("42.", 42.0),
        ("\n-17\t", -17.0),
        ("+3", 3.0),
        (".5", 0.5),
        ("1e3", 1000.0),
        ("-2.5E-2", -0.025),
        (42, 42.0),
        (2.5, 2.5),
    ],
)
def test_parse_number_reads_one_number(text: object, expected: float) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "forty-two",
        "42 apples",
        "The answer is 42",
        "1,000",
        "4 2",
        "nan",
        "inf",
        "-inf",
        "1e999",
        "0x10",
        "42\n43",
        ".",
        "-",
        True,
        None,
        [42],
        float("nan"),
        float("inf"),
    ],
)
def test_parse_number_refuses_anything_else(text: object) -> None:
    assert parse_number(text) is None


@pytest.mark.parametrize(
    ("answer", "target"),
    [
        ("42", 42),
        ("42.0", 42),
        (" 42 ", "42"),
        ("20", 20.0),
        ("0.3333333333333333", 1 / 3),
        ("0.333333333", 1 / 3),
        ("-143", -143),
        ("0", 0.0),
        ("1e3", "1000"),
    ],
)
def test_numbers_match_equal_numbers(answer: object, target: object) -> None:
    assert numbers_match(answer, target)


@pytest.mark.parametrize(
    ("answer", "target"),
    [
        ("41", 42),
        ("42", 43.5),
        ("0.33", 1 / 3),
        ("-42", 42),
        ("42 apples", 42),
        ("42", None),
        ("42", "forty-two"),
        ("", 0),
        ("0.001", 0),
    ],
)
def test_numbers_match_refuses_different_or_non_numbers(answer: object, target: object) -> None:
    assert not numbers_match(answer, target)


def test_numbers_match_tolerance_is_adjustable() -> None:
    assert not numbers_match("3.14", 3.14159)
    assert numbers_match("3.14", 3.14159, rel_tol=1e-3)
