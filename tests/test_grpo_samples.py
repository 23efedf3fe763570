"""Episodes to samples (advantages, masking, zero-variance skipping), packing, and the collate shift."""

from __future__ import annotations

import random

import pytest
import torch

from cookbook_lib.envs.base import Task
from cookbook_lib.grpo.losses import token_logprobs
from cookbook_lib.grpo.samples import TrainingSample, build_samples, collate, pack_micro_batches, version_mix
from cookbook_lib.rollout.episode import EndCause, Episode, Turn


def turn(prompt: list[int], sampled: list[int], logprob: float = -0.5, version: int = 0) -> Turn:
    return Turn(prompt, sampled, [logprob] * len(sampled), [version] * len(sampled))


def episode(cause: EndCause, reward: float, turns: list[Turn] | None = None) -> Episode:
    turns = [turn([1, 2, 3], [4, 5])] if turns is None else turns
    return Episode(task=Task("t"), messages=[], reward=reward, end_cause=cause, turns=turns)


def build(groups, **overrides):
    kwargs = {"normalize_by_std": False, "overlong_masking": False, "max_model_length": 100}
    return build_samples(groups, **(kwargs | overrides))


def by_episode(batch) -> dict[tuple[int, int], float]:
    return {(s.group_index, s.episode_index): s.advantage for s in batch.samples}


# --- advantages on samples ----------------------------------------------------------------------


def test_every_assistant_token_carries_the_episodes_advantage():
    group = [episode(EndCause.TERMINATED, r) for r in (1.0, 0.0, 0.0, 1.0)]
    batch = build([group], normalize_by_std=True, eps=0.0)
    # mean 0.5, population std 0.5: +-1
    assert [s.advantage for s in batch.samples] == pytest.approx([1.0, -1.0, -1.0, 1.0])
    for sample in batch.samples:
        assert sample.tokens_T == [1, 2, 3, 4, 5]
        assert sample.loss_mask_T == [False, False, False, True, True]
        assert sample.end_cause is EndCause.TERMINATED
    assert [s.episode_index for s in batch.samples] == [0, 1, 2, 3]


def test_multi_turn_sample_trains_only_sampled_tokens():
    # turn 2's prompt: turn 1's tokens + a closing token (6) + a tool output (7, 7)
    turns = [
        turn([1, 2, 3], [4, 5], -0.1, version=3),
        turn([1, 2, 3, 4, 5, 6, 7, 7], [8, 9], -0.2, version=4),
    ]
    group = [episode(EndCause.TERMINATED, 1.0, turns), episode(EndCause.TERMINATED, 0.0)]
    sample = build([group]).samples[0]
    assert sample.tokens_T == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9]
    assert sample.loss_mask_T == [False, False, False, True, True, False, False, False, True, True]
    assert sample.sampling_logprobs_T == [0, 0, 0, -0.1, -0.1, 0, 0, 0, -0.2, -0.2]
    assert sample.policy_versions_T == [-1, -1, -1, 3, 3, -1, -1, -1, 4, 4]
    assert sample.advantage == 0.5  # 1 - mean(1, 0)


def test_a_rewritten_history_gives_several_samples_with_the_same_advantage():
    turns = [turn([1, 2, 3], [4, 5]), turn([1, 9, 9], [6])]  # the template dropped [2, 3, 4, 5]
    group = [episode(EndCause.TERMINATED, 3.0, turns), episode(EndCause.TERMINATED, 1.0)]
    batch = build([group])
    first, second, other = batch.samples
    assert (first.tokens_T, second.tokens_T) == ([1, 2, 3, 4, 5], [1, 9, 9, 6])
    assert second.loss_mask_T == [False, False, False, True]
    assert first.advantage == second.advantage == 1.0  # 3 - mean(3, 1)
    assert first.episode_index == second.episode_index == 0
    assert other.advantage == -1.0


def test_episodes_without_sampled_turns_give_no_samples():
    group = [episode(EndCause.TERMINATED, 1.0, turns=[]), episode(EndCause.TERMINATED, 0.0)]
    batch = build([group])
    assert [s.episode_index for s in batch.samples] == [1]
    assert batch.samples[0].advantage == -0.5  # the scripted episode still counts in the baseline


# --- zero variance ------------------------------------------------------------------------------


def test_zero_variance_groups_are_skipped_and_counted():
    groups = [
        [episode(EndCause.TERMINATED, 1.0), episode(EndCause.TERMINATED, 1.0)],
        [episode(EndCause.TERMINATED, 1.0), episode(EndCause.TERMINATED, 0.0)],
        [episode(EndCause.TERMINATED, 0.0), episode(EndCause.TERMINATED, 0.0)],
        [episode(EndCause.TERMINATED, 0.2), episode(EndCause.TERMINATED, 0.0)],
    ]
    batch = build(groups)
    assert batch.trained_group_indices == [1, 3]
    assert {s.group_index for s in batch.samples} == {1, 3}
    assert batch.stats.num_zero_variance_groups == 2
    assert batch.stats.zero_variance_skip_ratio == 0.5
    assert batch.stats.metrics()["zero_variance_skip_ratio"] == 0.5


def test_the_overlong_penalty_can_give_a_group_signal():
    overflow = episode(
        EndCause.CONTEXT_OVERFLOW, 0.0, [turn(list(range(1, 91)), list(range(10)))]
    )  # 100 tokens
    group = [episode(EndCause.TERMINATED, 0.0), overflow]
    assert build([group]).stats.num_zero_variance_groups == 1
    batch = build([group], overlong_buffer_tokens=20, overlong_penalty_factor=1.0)
    # shaped [0, -1]: mean -0.5
    assert by_episode(batch) == {(0, 0): 0.5, (0, 1): -0.5}
    stats = batch.stats.metrics()
    assert (stats["reward_mean"], stats["reward_std"]) == (0.0, 0.0)
    assert (stats["shaped_reward_mean"], stats["shaped_reward_std"]) == (-0.5, 0.5)
    assert stats["num_penalised_episodes"] == 1


# --- truncation masking -------------------------------------------------------------------------


def test_overlong_masking_drops_truncated_samples_but_keeps_their_rewards_in_the_baseline():
    long_context = turn(list(range(1, 91)), list(range(10)))  # 100 tokens: the full penalty
    group = [
        episode(EndCause.TERMINATED, 1.0),
        episode(EndCause.CONTEXT_OVERFLOW, 0.0, [long_context]),  # shaped 0 - 1 = -1
        episode(EndCause.TERMINATED, 0.0),
        episode(EndCause.PARSE_FAILURE, 0.0),
        episode(EndCause.ENV, 0.5),
    ]
    penalty = {"overlong_buffer_tokens": 20, "overlong_penalty_factor": 1.0}
    batch = build([group], overlong_masking=True, **penalty)
    # shaped rewards [1, -1, 0, 0, 0.5], mean 0.1; without the masked ones it would be 0.5
    assert by_episode(batch) == pytest.approx({(0, 0): 0.9, (0, 2): -0.1})
    assert batch.stats.num_masked_episodes == 3
    unmasked = build([group], overlong_masking=False, **penalty)
    assert by_episode(unmasked) == pytest.approx(
        {(0, 0): 0.9, (0, 1): -1.1, (0, 2): -0.1, (0, 3): -0.1, (0, 4): 0.4}
    )


# --- ERROR episodes -----------------------------------------------------------------------------


def test_error_episodes_leave_the_group_entirely():
    group = [
        episode(EndCause.TERMINATED, 1.0),
        episode(EndCause.ERROR, 0.0),
        episode(EndCause.TERMINATED, 0.0),
    ]
    batch = build([group])
    # the baseline is mean(1, 0) = 0.5, not mean(1, 0, 0) = 1/3
    assert by_episode(batch) == {(0, 0): 0.5, (0, 2): -0.5}
    assert batch.stats.num_error_episodes == 1
    assert batch.stats.rewards == [1.0, 0.0]


def test_groups_of_errors_are_empty_and_one_survivor_is_zero_variance():
    only_errors = [episode(EndCause.ERROR, 0.0), episode(EndCause.ERROR, 0.0)]
    one_left = [episode(EndCause.ERROR, 0.0), episode(EndCause.TERMINATED, 1.0)]
    batch = build([only_errors, one_left])
    assert batch.samples == []
    assert (batch.stats.num_empty_groups, batch.stats.num_zero_variance_groups) == (1, 1)
    assert batch.stats.num_error_episodes == 3
    assert build([only_errors]).stats.metrics().get("reward_mean") is None


# --- TrainingSample checks ----------------------------------------------------------------------


def sample(length: int, advantage: float = 1.0) -> TrainingSample:
    return TrainingSample(
        tokens_T=list(range(length)),
        loss_mask_T=[False] + [True] * (length - 1),
        sampling_logprobs_T=[0.0] * length,
        policy_versions_T=[0] * length,
        advantage=advantage,
        group_index=0,
        episode_index=length,
        end_cause=EndCause.TERMINATED,
        reward=0.0,
    )


def test_training_sample_checks_lengths_and_the_first_token():
    with pytest.raises(ValueError, match="length"):
        TrainingSample([1, 2], [False, True], [0.0], [0, 0], 1.0, 0, 0, EndCause.TERMINATED, 0.0)
    with pytest.raises(ValueError, match="prompt token"):
        TrainingSample([1, 2], [True, True], [0.0, 0.0], [0, 0], 1.0, 0, 0, EndCause.TERMINATED, 0.0)
    assert sample(4).num_loss_tokens == 3


# --- packing ------------------------------------------------------------------------------------


def test_packing_by_hand():
    samples = [sample(n) for n in (5, 3, 8, 2, 2, 7)]
    batches = pack_micro_batches(samples, token_budget=16)
    # longest first: [8, 7] costs 2 * 8 = 16; [5, 3, 2] costs 15 (a fourth would cost 20); [2]
    assert [[len(s) for s in b] for b in batches] == [[8, 7], [5, 3, 2], [2]]


def test_a_sample_over_the_budget_gets_its_own_micro_batch():
    batches = pack_micro_batches([sample(3), sample(20), sample(4)], token_budget=10)
    assert [[len(s) for s in b] for b in batches] == [[20], [4, 3]]


def test_packing_fits_the_budget_keeps_every_sample_once_and_is_deterministic():
    rng = random.Random(0)
    for _ in range(50):
        samples = [sample(rng.randint(2, 40)) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(10, 120)
        batches = pack_micro_batches(samples, budget)
        packed = [id(s) for b in batches for s in b]
        assert sorted(packed) == sorted(id(s) for s in samples)
        for b in batches:
            assert len(b) * max(len(s) for s in b) <= budget or len(b) == 1
        assert [[id(s) for s in b] for b in pack_micro_batches(samples, budget)] == [
            [id(s) for s in b] for b in batches
        ]


def test_packing_rejects_a_nonpositive_budget():
    with pytest.raises(ValueError):
        pack_micro_batches([sample(3)], 0)


# --- collate ------------------------------------------------------------------------------------


def test_collate_shifts_once_and_right_pads():
    a = TrainingSample(
        [10, 11, 12, 13],
        [False, False, True, True],
        [0.0, 0.0, -0.5, -0.25],
        [-1, -1, 2, 2],
        2.0,
        0,
        0,
        EndCause.TERMINATED,
        1.0,
    )
    b = TrainingSample(
        [20, 21, 22],
        [False, True, False],
        [0.0, -1.5, 0.0],
        [-1, 3, -1],
        -1.0,
        0,
        1,
        EndCause.TERMINATED,
        0.0,
    )
    batch = collate([a, b], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[10, 11, 12], [20, 21, 0]]
    assert batch["target_ids"].tolist() == [[11, 12, 13], [21, 22, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["advantages"].tolist() == [[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]
    assert batch["sampling_logprobs"].tolist() == [[0.0, -0.5, -0.25], [-1.5, 0.0, 0.0]]
    assert batch["policy_versions"].tolist() == [[-1, 2, 2], [3, -1, -1]]
    with pytest.raises(ValueError):
        collate([], pad_token_id=0)


def test_collated_targets_line_up_with_the_models_predictions():
    # A bigram "model": the logits at a position depend only on the token there, so the
    # log-prob of token t+1 must be log_softmax(W[token t])[token t+1].
    torch.manual_seed(0)
    weights_VV = torch.randn(30, 30)
    tokens = [3, 17, 5, 22, 9]
    s = TrainingSample(
        tokens, [False, False, True, True, True], [0.0] * 5, [0] * 5, 1.0, 0, 0, EndCause.TERMINATED, 0.0
    )
    batch = collate([s], pad_token_id=0)
    logprobs_BT = token_logprobs(weights_VV[batch["input_ids"]], batch["target_ids"])
    expected = [torch.log_softmax(weights_VV[tokens[t]], -1)[tokens[t + 1]].item() for t in range(4)]
    assert logprobs_BT[0].tolist() == pytest.approx(expected, abs=1e-6)
    # the trained positions score exactly the sampled tokens 5, 22, 9
    assert batch["target_ids"][batch["loss_mask"]].tolist() == [5, 22, 9]


def test_build_then_collate_trains_exactly_the_assistant_tokens():
    turns = [turn([1, 2, 3], [4, 5], -0.1), turn([1, 2, 3, 4, 5, 6, 7], [8], -0.2)]
    group = [episode(EndCause.TERMINATED, 1.0, turns), episode(EndCause.TERMINATED, 0.0)]
    batch = build([group])
    tensors = collate(batch.samples, pad_token_id=0)
    assert tensors["target_ids"][0][tensors["loss_mask"][0]].tolist() == [4, 5, 8]
    assert tensors["advantages"][0].tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5]
    assert tensors["loss_mask"].sum().item() == batch.num_loss_tokens == 5


def test_version_mix_counts_newer_tokens_and_mixed_replies():
    # Two replies: the first sampled by version 0 then 1 (weights switched mid-reply, PIPELINE),
    # the second by version 1 after a tool result (a newer version for the next turn).
    mixed = TrainingSample(
        tokens_T=list(range(9)),
        loss_mask_T=[False, True, True, True, False, False, True, True, False],
        sampling_logprobs_T=[0.0] * 9,
        policy_versions_T=[-1, 0, 0, 1, -1, -1, 1, 1, -1],
        advantage=1.0,
        group_index=0,
        episode_index=0,
        end_cause=EndCause.TERMINATED,
        reward=1.0,
    )
    assert version_mix([mixed, sample(4)]) == {"newer_version_tokens": 3.0, "mixed_version_replies": 1.0}
    assert version_mix([sample(5)]) == {"newer_version_tokens": 0.0, "mixed_version_replies": 0.0}
