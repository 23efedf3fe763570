"""Group advantages, zero-variance detection and the soft overlong penalty, against hand computations."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from cookbook_lib.envs.base import Task
from cookbook_lib.grpo.advantages import group_advantages, is_usable, is_zero_variance, shaped_rewards
from cookbook_lib.grpo.overlong import context_length, overlong_penalty, soft_overlong_penalty
from cookbook_lib.rollout.episode import EndCause, Episode, Turn


def episode(end_cause: EndCause, reward: float = 0.0, turns: Sequence[tuple[int, int]] = ()) -> Episode:
    """An episode whose turns have the given (prompt length, sampled length), each extending the last."""
    recorded, tokens = [], []
    for prompt_len, sampled_len in turns:
        prompt = tokens + list(range(1000, 1000 + prompt_len - len(tokens)))
        sampled = list(range(2000, 2000 + sampled_len))
        recorded.append(Turn(prompt, sampled, [-0.5] * sampled_len, [0] * sampled_len))
        tokens = prompt + sampled
    return Episode(task=Task("t"), messages=[], reward=reward, end_cause=end_cause, turns=recorded)


# --- group advantages -------------------------------------------------------------------------


def test_advantages_without_std_are_reward_minus_mean():
    # mean 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0], normalize_by_std=False) == [0.5, -0.5, -0.5, 0.5]
    # mean 2: 3 - 2, 1 - 2, 2 - 2
    assert group_advantages([3.0, 1.0, 2.0], normalize_by_std=False) == [1.0, -1.0, 0.0]


def test_advantages_with_std_use_the_population_std():
    # [1, 0, 0, 1]: mean 0.5, centred +-0.5, population std 0.5 -> +-1
    assert group_advantages([1.0, 0.0, 0.0, 1.0], True, eps=0.0) == pytest.approx([1, -1, -1, 1])
    # [3, 1, 2]: centred [1, -1, 0], std sqrt(2/3) = 0.816497 -> 1 / 0.816497 = 1.224745
    assert group_advantages([3.0, 1.0, 2.0], True, eps=0.0) == pytest.approx([1.224745, -1.224745, 0.0])
    # eps is added to the std: 0.5 / (0.5 + 0.5) = 0.5
    assert group_advantages([1.0, 0.0], True, eps=0.5) == pytest.approx([0.5, -0.5])


def test_advantages_of_an_empty_group_are_empty():
    assert group_advantages([], normalize_by_std=True) == []


def test_zero_variance_uses_a_tolerance():
    assert is_zero_variance([1.0, 1.0, 1.0])
    assert is_zero_variance([0.3, 0.1 + 0.2])  # float noise: 0.30000000000000004
    assert not is_zero_variance([1.0, 1.1])
    assert not is_zero_variance([0.0, 0.0, 1e-3])
    assert is_zero_variance([0.0, 0.05], tol=0.1)


def test_fewer_than_two_rewards_give_no_signal():
    assert is_zero_variance([0.7])
    assert is_zero_variance([])


# --- the soft overlong penalty ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (79, 0.0),
        (80, 0.0),  # limit - buffer: the ramp starts here
        (85, -0.25),  # 5 of 20 buffer tokens
        (90, -0.5),
        (95, -0.75),
        (100, -1.0),  # the limit
        (130, -1.0),  # beyond it: still -factor
    ],
)
def test_ramp_points(length, expected):
    assert soft_overlong_penalty(length, max_model_length=100, buffer_tokens=20, factor=1.0) == pytest.approx(
        expected
    )


def test_ramp_scales_with_the_factor():
    assert soft_overlong_penalty(90, 100, 20, factor=2.0) == pytest.approx(-1.0)
    assert soft_overlong_penalty(100, 100, 20, factor=0.3) == pytest.approx(-0.3)


def test_zero_buffer_or_zero_factor_turns_the_penalty_off():
    assert soft_overlong_penalty(100, 100, buffer_tokens=0, factor=1.0) == 0.0
    assert soft_overlong_penalty(100, 100, buffer_tokens=20, factor=0.0) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_model_length": 0, "buffer_tokens": 0, "factor": 1.0},
        {"max_model_length": 100, "buffer_tokens": -1, "factor": 1.0},
        {"max_model_length": 100, "buffer_tokens": 101, "factor": 1.0},
        {"max_model_length": 100, "buffer_tokens": 10, "factor": -1.0},
    ],
)
def test_bad_penalty_settings_raise(kwargs):
    with pytest.raises(ValueError):
        soft_overlong_penalty(50, **kwargs)


def test_context_length_is_the_last_turns_prompt_plus_sample():
    # turn 1: 10 prompt + 5 sampled; turn 2's prompt extends it to 20, then 70 sampled: 90
    assert context_length(episode(EndCause.MAX_TURNS, turns=[(10, 5), (20, 70)])) == 90
    assert context_length(episode(EndCause.MAX_TURNS)) == 0


def test_context_length_after_a_rewritten_history_is_the_new_sequence():
    ep = episode(EndCause.CONTEXT_OVERFLOW, turns=[(10, 80)])
    ep.turns.append(
        Turn(prompt_tokens=[7] * 6, sampled_tokens=[8] * 4, logprobs=[0.0] * 4, policy_versions=[0] * 4)
    )
    assert len(ep.token_sequences()) == 2
    assert context_length(ep) == 10


@pytest.mark.parametrize(
    ("cause", "expected"),
    [
        (EndCause.CONTEXT_OVERFLOW, -0.5),
        (EndCause.MAX_TURNS, -0.5),
        (EndCause.ENV, 0.0),
        (EndCause.PARSE_FAILURE, 0.0),
        (EndCause.TERMINATED, 0.0),
        (EndCause.ERROR, 0.0),
    ],
)
def test_penalty_applies_only_to_context_overflow_and_max_turns(cause, expected):
    ep = episode(cause, turns=[(60, 30)])  # length 90 on a ramp over [80, 100]: -0.5
    assert overlong_penalty(ep, max_model_length=100, buffer_tokens=20, factor=1.0) == pytest.approx(expected)


def test_max_turns_on_a_short_context_is_not_penalised():
    ep = episode(EndCause.MAX_TURNS, turns=[(10, 5), (20, 5), (30, 5)])  # 35 tokens, far from 80
    assert overlong_penalty(ep, 100, 20, 1.0) == 0.0


# --- shaped rewards -----------------------------------------------------------------------------


def test_shaped_rewards_add_the_penalty_and_leave_parse_failures_alone():
    episodes = [
        episode(EndCause.TERMINATED, 1.0, [(60, 40)]),  # length 100, but terminated: 1
        episode(EndCause.CONTEXT_OVERFLOW, 0.0, [(60, 30)]),  # 0 - 0.5
        episode(EndCause.MAX_TURNS, 0.2, [(60, 35)]),  # 0.2 - 0.75
        episode(EndCause.PARSE_FAILURE, -0.1, [(60, 40)]),  # failed_parse_reward, set by the rollout: kept
        episode(EndCause.ENV, 0.0, [(60, 40)]),  # 0
    ]
    shaped = shaped_rewards(
        episodes, max_model_length=100, overlong_buffer_tokens=20, overlong_penalty_factor=1.0
    )
    assert shaped == pytest.approx([1.0, -0.5, -0.55, -0.1, 0.0])


def test_shaped_rewards_without_a_penalty_are_the_rewards():
    episodes = [episode(EndCause.CONTEXT_OVERFLOW, 0.25, [(60, 40)]), episode(EndCause.TERMINATED, 1.0)]
    assert shaped_rewards(episodes, max_model_length=100) == [0.25, 1.0]


def test_error_episodes_are_not_usable():
    assert [is_usable(episode(cause)) for cause in EndCause] == [
        cause is not EndCause.ERROR for cause in EndCause
    ]


def test_normalised_advantages_have_zero_mean_and_unit_variance():
    advantages = group_advantages([0.0, 0.2, 0.9, 1.0, 0.4], normalize_by_std=True, eps=0.0)
    assert sum(advantages) == pytest.approx(0.0, abs=1e-12)
    assert math.sqrt(sum(a * a for a in advantages) / len(advantages)) == pytest.approx(1.0)
