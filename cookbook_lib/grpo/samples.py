"""From groups of episodes to padded tensors: samples, micro-batches, and the collate.

Shape suffixes: ``_T`` is one entry per token of a sample, ``_G`` one per episode of a group,
``_B`` one per sample of a micro-batch (tensors from :func:`collate` are ``[B, T]``).

One sample per token sequence of an episode: usually one, more where the chat template rewrote
the history (``Episode.token_sequences``), so no sample holds tokens the model did not see when it
sampled. Only the sampled (assistant) tokens are trained, each with the episode's advantage;
prompt, tool-output and turn-closing tokens are context, never targets.

Truncation: with ``overlong_masking`` an episode of any truncation cause gives no samples, but its
(shaped) reward still counts in its group's baseline, as the seed says: masking decides what is
trained, not what the other episodes are compared with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cookbook_lib.grpo.advantages import group_advantages, is_usable, is_zero_variance, shaped_rewards
from cookbook_lib.rollout.episode import EndCause, Episode


@dataclass
class TrainingSample:
    """One token sequence to train on; ``loss_mask_T`` marks the sampled tokens (the targets)."""

    tokens_T: list[int]
    loss_mask_T: list[bool]
    sampling_logprobs_T: list[float]
    policy_versions_T: list[int]
    advantage: float  # the same for every trained token of the episode
    group_index: int
    episode_index: int  # the episode's index within its group
    end_cause: EndCause
    reward: float  # the shaped reward the advantage was computed from

    def __post_init__(self) -> None:
        n = len(self.tokens_T)
        lengths = (len(self.loss_mask_T), len(self.sampling_logprobs_T), len(self.policy_versions_T))
        if any(length != n for length in lengths):
            raise ValueError(f"token fields differ in length: tokens {n}, mask/logprobs/versions {lengths}")
        if n < 2 or self.loss_mask_T[0]:
            # Nothing precedes the first token, so it cannot be a target (see collate).
            raise ValueError("a sample needs a prompt token before its first trained token")

    def __len__(self) -> int:
        return len(self.tokens_T)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask_T)


@dataclass
class SampleStats:
    """What happened to the groups on the way to samples, for the step's metrics."""

    num_groups: int = 0
    num_zero_variance_groups: int = 0  # all (usable) rewards equal: skipped
    num_empty_groups: int = 0  # every episode ended in ERROR: skipped
    num_episodes: int = 0
    num_error_episodes: int = 0  # left out of their group entirely
    num_penalised_episodes: int = 0  # got a nonzero overlong penalty
    num_masked_episodes: int = 0  # truncated, in a trained group, and dropped by overlong_masking
    rewards: list[float] = field(default_factory=list)  # usable episodes, before shaping
    shaped: list[float] = field(default_factory=list)  # the same episodes, after shaping

    @property
    def zero_variance_skip_ratio(self) -> float:
        return self.num_zero_variance_groups / self.num_groups if self.num_groups else 0.0

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "num_groups": self.num_groups,
            "zero_variance_skip_ratio": self.zero_variance_skip_ratio,
            "num_empty_groups": self.num_empty_groups,
            "num_error_episodes": self.num_error_episodes,
            "num_penalised_episodes": self.num_penalised_episodes,
            "num_masked_episodes": self.num_masked_episodes,
        }
        if self.rewards:  # no usable episode: no reward statistics rather than made-up zeros
            out |= {"reward_mean": _mean(self.rewards), "reward_std": _std(self.rewards)}
            out |= {"shaped_reward_mean": _mean(self.shaped), "shaped_reward_std": _std(self.shaped)}
        return out


@dataclass
class SampleBatch:
    """The samples of one optimizer step, the groups they came from, and the stats."""

    samples: list[TrainingSample]
    trained_group_indices: list[int]  # groups that gave signal (they may still give no samples)
    stats: SampleStats
    # Per zero-variance group, in order: what its episodes would add to the loss's counts (their
    # sampled tokens and token sequences) had they been trained; see ``GRPOConfig.loss_normalizer``.
    zero_variance_counts: list[LossCounts] = field(default_factory=list)

    @property
    def num_loss_tokens(self) -> int:
        """The token-mean normaliser for the whole step (pass it to every micro-batch's loss)."""
        return sum(sample.num_loss_tokens for sample in self.samples)


@dataclass(frozen=True)
class LossCounts:
    """What a set of samples adds to the loss's normalisers: trained tokens and token sequences."""

    tokens: int
    sequences: int

    @classmethod
    def of(cls, samples: Sequence[TrainingSample]) -> LossCounts:
        return cls(sum(sample.num_loss_tokens for sample in samples), len(samples))

    def __add__(self, other: LossCounts) -> LossCounts:
        return LossCounts(self.tokens + other.tokens, self.sequences + other.sequences)


def build_samples(
    groups: Sequence[Sequence[Episode]],
    *,
    normalize_by_std: bool,
    overlong_masking: bool,
    max_model_length: int,
    overlong_buffer_tokens: int = 0,
    overlong_penalty_factor: float = 0.0,
    eps: float = 1e-6,
    zero_variance_tol: float = 1e-6,
) -> SampleBatch:
    """Shape rewards, compute group advantages, skip groups without signal, and build samples.

    ``ERROR`` episodes are left out of their group (see :mod:`.advantages`); a group left with
    fewer than two episodes, or with all shaped rewards equal, is a zero-variance group.
    """
    stats = SampleStats(num_groups=len(groups))
    samples: list[TrainingSample] = []
    trained: list[int] = []
    zero_variance_counts: list[LossCounts] = []
    for group_index, group in enumerate(groups):
        stats.num_episodes += len(group)
        usable = [i for i, episode in enumerate(group) if is_usable(episode)]
        stats.num_error_episodes += len(group) - len(usable)
        if not usable:
            stats.num_empty_groups += 1
            continue
        episodes_G = [group[i] for i in usable]
        rewards_G = [float(episode.reward) for episode in episodes_G]
        shaped_G = shaped_rewards(
            episodes_G,
            max_model_length=max_model_length,
            overlong_buffer_tokens=overlong_buffer_tokens,
            overlong_penalty_factor=overlong_penalty_factor,
        )
        stats.rewards += rewards_G
        stats.shaped += shaped_G
        stats.num_penalised_episodes += sum(s != r for s, r in zip(shaped_G, rewards_G, strict=True))
        zero_variance = is_zero_variance(shaped_G, zero_variance_tol)
        if zero_variance:
            stats.num_zero_variance_groups += 1
        else:
            trained.append(group_index)
        if zero_variance:
            advantages_G = [0.0] * len(shaped_G)
        else:
            advantages_G = group_advantages(shaped_G, normalize_by_std, eps)
        group_samples: list[TrainingSample] = []
        for episode_index, episode, advantage, reward in zip(
            usable, episodes_G, advantages_G, shaped_G, strict=True
        ):
            if overlong_masking and episode.truncated:
                stats.num_masked_episodes += not zero_variance
                continue
            group_samples += episode_samples(episode, group_index, episode_index, advantage, reward)
        if zero_variance:
            zero_variance_counts.append(LossCounts.of(group_samples))
        else:
            samples += group_samples
    return SampleBatch(
        samples=samples, trained_group_indices=trained, stats=stats, zero_variance_counts=zero_variance_counts
    )


def episode_samples(
    episode: Episode, group_index: int, episode_index: int, advantage: float, reward: float
) -> list[TrainingSample]:
    """One sample per token sequence of ``episode`` that holds sampled tokens."""
    return [
        TrainingSample(
            tokens_T=list(sequence.tokens_T),
            loss_mask_T=list(sequence.assistant_mask_T),
            sampling_logprobs_T=list(sequence.sampling_logprobs_T),
            policy_versions_T=list(sequence.policy_versions_T),
            advantage=advantage,
            group_index=group_index,
            episode_index=episode_index,
            end_cause=episode.end_cause,
            reward=reward,
        )
        for sequence in episode.token_sequences()
        if any(sequence.assistant_mask_T)
    ]


def version_mix(samples: Sequence[TrainingSample]) -> dict[str, float]:
    """How many policy versions sampled what a step trains: ``newer_version_tokens``, the trained
    tokens sampled by a newer version than their sample's first trained token (weights that
    changed while an episode played), and ``mixed_version_replies``, the replies (runs of sampled
    tokens) whose tokens come from more than one version (``WEIGHT_SYNC_TYPE_PIPELINE`` switches
    weights between two decode steps). Both are 0 in lockstep."""
    newer = mixed = 0
    for sample in samples:
        trained = [v for v, m in zip(sample.policy_versions_T, sample.loss_mask_T, strict=True) if m]
        if trained:
            newer += sum(version > trained[0] for version in trained)
        reply: set[int] = set()
        for version, is_loss in zip(sample.policy_versions_T, sample.loss_mask_T, strict=True):
            if is_loss:
                reply.add(version)
            elif reply:
                mixed += len(reply) > 1
                reply = set()
        mixed += len(reply) > 1
    return {"newer_version_tokens": float(newer), "mixed_version_replies": float(mixed)}


def pack_micro_batches(samples: Sequence[TrainingSample], token_budget: int) -> list[list[TrainingSample]]:
    """Greedy, deterministic packing so each micro-batch's *padded* size fits ``token_budget``.

    A micro-batch is right-padded to its longest sample, so its cost is ``len(batch) * max_len``.
    Samples are taken longest first (ties by input order): each batch's first sample sets its
    ``max_len`` and similar lengths follow it, which keeps padding small. A sample longer than the
    budget gets a micro-batch of its own (it cannot be split without changing what it attends to).
    Every sample appears exactly once; gradient accumulation makes the order irrelevant.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i))
    batches: list[list[TrainingSample]] = []
    for i in order:
        sample = samples[i]
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0]) <= token_budget:
            batches[-1].append(sample)
        else:
            batches.append([sample])
    return batches


def collate(micro_batch: Sequence[TrainingSample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, T]`` tensors, already shifted for next-token prediction.

    The shift happens here and nowhere else. For a sample of ``L`` tokens, ``T = L - 1``:
    ``input_ids[t] = tokens[t]`` and ``target_ids[t] = tokens[t + 1]``, so the model's output at
    position ``t`` (which has seen ``tokens[: t + 1]``) scores ``target_ids[t]``. Every per-token
    field (``loss_mask``, ``advantages``, ``sampling_logprobs``, ``policy_versions``) is aligned
    with ``target_ids``: it is the sample's field from index 1 on. The trainer gathers
    ``log_softmax(logits)`` at ``target_ids`` and never shifts again.

    Padding has ``attention_mask`` 0, ``loss_mask`` False, advantage and logprob 0, version -1.
    """
    if not micro_batch:
        raise ValueError("collate needs at least one sample")
    width = max(len(sample) for sample in micro_batch) - 1
    batch = {
        "input_ids": torch.full((len(micro_batch), width), pad_token_id, dtype=torch.long),
        "target_ids": torch.full((len(micro_batch), width), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(micro_batch), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(micro_batch), width), dtype=torch.bool),
        "advantages": torch.zeros((len(micro_batch), width), dtype=torch.float32),
        "sampling_logprobs": torch.zeros((len(micro_batch), width), dtype=torch.float32),
        "policy_versions": torch.full((len(micro_batch), width), -1, dtype=torch.long),
    }
    for b, sample in enumerate(micro_batch):
        n = len(sample) - 1
        mask_T = torch.tensor(sample.loss_mask_T[1:], dtype=torch.bool)
        batch["input_ids"][b, :n] = torch.tensor(sample.tokens_T[:-1])
        batch["target_ids"][b, :n] = torch.tensor(sample.tokens_T[1:])
        batch["attention_mask"][b, :n] = 1
        batch["loss_mask"][b, :n] = mask_T
        batch["advantages"][b, :n] = torch.where(mask_T, sample.advantage, 0.0)
        batch["sampling_logprobs"][b, :n] = torch.tensor(sample.sampling_logprobs_T[1:])
        batch["policy_versions"][b, :n] = torch.tensor(sample.policy_versions_T[1:])
    return batch


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
