"""Multi-turn-shaped training samples for the prefix-tree tests (shared prompt, groups, a duplicate
and a prefix of another sample), and a GRPO step's gradients captured before the optimizer steps."""

from __future__ import annotations

import copy
import math
import random

from cookbook_lib.grpo.samples import TrainingSample
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout.episode import EndCause


def sample(
    tokens: list[int], mask: list[bool], vocab: int, advantage: float = 1.0, group: int = 0
) -> TrainingSample:
    # Near the tiny model's own (almost uniform) log-probs, so importance ratios stay near 1,
    # inside the clip range, and every trained token carries a gradient worth comparing.
    rng = random.Random(len(tokens) * 7 + sum(tokens))
    return TrainingSample(
        tokens_T=tokens,
        loss_mask_T=mask,
        sampling_logprobs_T=[-math.log(vocab) + rng.uniform(-0.1, 0.1) if m else 0.0 for m in mask],
        policy_versions_T=[0] * len(tokens),
        advantage=advantage,
        group_index=group,
        episode_index=0,
        end_cause=EndCause.TERMINATED,
        reward=advantage,
    )


def episodes(vocab: int, seed: int = 0) -> list[TrainingSample]:
    """Multi-turn-shaped samples: one system prompt, two groups with their own task, replies
    (trained) and tool results (not) of varied lengths; one exact duplicate; one that is a
    prefix of another's inputs."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    system = tokens(24)
    samples = []
    for group in range(2):
        task = tokens(6)
        for episode in range(3):
            seq, mask = system + task, [False] * (len(system) + len(task))
            for _turn in range(rng.randrange(1, 3)):
                reply, result = tokens(rng.randrange(3, 9)), tokens(rng.randrange(2, 5))
                seq, mask = seq + reply + result, mask + [True] * len(reply) + [False] * len(result)
            samples.append(sample(seq, mask, vocab, advantage=(-1.0) ** episode * (episode + 1), group=group))
    samples.append(copy.deepcopy(samples[0]))
    first = samples[1]
    cut = first.loss_mask_T.index(True) + 2
    samples.append(sample(first.tokens_T[:cut], first.loss_mask_T[:cut], vocab, advantage=0.5))
    return samples


def step_gradients(trainer: PolicyTrainer, samples, settings, counts=None):
    captured = {}

    def capture() -> None:
        captured.update(
            {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        )

    trainer.optimizer.step = capture
    metrics = trainer.grpo_step(samples, settings, counts)
    return metrics, captured
