"""``loss_normalizer``: what a GRPO step's loss is averaged over. ``batch_groups`` counts the
zero-variance groups that stand in for missing signal, as a loss over every sampled episode (TRL's,
verl's) does; ``trained_groups`` (the default) counts only the groups the step trains."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from prefix_tree_samples import episodes, step_gradients

from cookbook_lib.envs.base import Task
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.lockstep import loss_counts, step_samples, train_on_groups
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.samples import LossCounts
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout.episode import EndCause, Episode, Turn


def episode(reward: float, sampled: int, turns: int = 1) -> Episode:
    """An episode of ``turns`` turns that each sample ``sampled`` tokens after a 3-token prompt."""
    history: list[int] = []
    made = []
    for _ in range(turns):
        prompt = [*history, 1, 2, 3]
        reply = list(range(10, 10 + sampled))
        made.append(Turn(prompt, reply, [-0.5] * sampled, [0] * sampled))
        history = prompt + reply
    return Episode(task=Task("t"), messages=[], reward=reward, end_cause=EndCause.TERMINATED, turns=made)


def config(**overrides) -> GRPOConfig:
    return GRPOConfig(**({"model": "m", "batch_size": 4, "episodes_per_task": 2} | overrides))


# Groups 0 and 2 have signal; 1 (3 + 3 tokens) and 3 (5 + 5 tokens) are zero-variance.
GROUPS = [
    [episode(1.0, 2), episode(0.0, 4)],
    [episode(1.0, 3), episode(1.0, 3)],
    [episode(0.0, 6), episode(1.0, 2)],
    [episode(0.0, 5), episode(0.0, 5)],
]


def test_zero_variance_groups_record_what_they_would_add_to_the_counts():
    batch, samples, keep = step_samples(config(), GROUPS)
    assert keep == {0, 2}
    assert LossCounts.of(samples) == LossCounts(tokens=2 + 4 + 6 + 2, sequences=4)
    assert batch.zero_variance_counts == [LossCounts(6, 2), LossCounts(10, 2)]
    assert all(sample.group_index in keep for sample in batch.samples)


@pytest.mark.parametrize(
    ("normalizer", "batch_size", "want"),
    [
        ("trained_groups", 4, LossCounts(14, 4)),
        ("batch_groups", 4, LossCounts(14 + 6 + 10, 8)),  # both zero-variance groups fill the batch
        ("batch_groups", 3, LossCounts(14 + 6, 6)),  # one is missing: the first zero-variance group
        ("batch_groups", 2, LossCounts(14, 4)),  # the batch is full of signal
    ],
)
def test_batch_groups_count_the_zero_variance_groups_that_stand_in_for_missing_signal(
    normalizer, batch_size, want
):
    settings = config(loss_normalizer=normalizer, batch_size=batch_size)
    batch, samples, keep = step_samples(settings, GROUPS)
    assert loss_counts(settings, batch, samples, keep) == want


def test_a_turn_per_sequence_counts_each_sequence():
    # Two turns whose second prompt extends the first: one token sequence, counted once.
    groups = [[episode(1.0, 2), episode(0.0, 2)], [episode(1.0, 2, turns=2), episode(1.0, 2, turns=2)]]
    batch, _, _ = step_samples(config(), groups)
    assert batch.zero_variance_counts == [LossCounts(8, 2)]


def test_the_normalizer_is_checked_before_anything_loads():
    with pytest.raises(ValueError, match="loss_normalizer"):
        config(loss_normalizer="everything").validate()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "fixed_horizon"])
def test_batch_counts_give_the_gradient_of_a_loss_over_every_sampled_episode(
    tiny_model_and_tokenizer, aggregation
):
    """Training the groups with signal, normalised by counts that include zero-advantage samples,
    equals training all of them (advantage 0 adds no gradient, only to the count)."""
    base, tokenizer = tiny_model_and_tokenizer
    vocab = len(tokenizer)
    signal = episodes(vocab, seed=3)
    zero = [dataclasses.replace(s, advantage=0.0, group_index=7) for s in episodes(vocab, seed=4)[:5]]
    settings = LossSettings(aggregation=aggregation, horizon=64)
    results = []
    for samples, counts in ((signal + zero, None), (signal, LossCounts.of(signal + zero)), (signal, None)):
        # No clipping: the captured gradients are the loss's own.
        trainer = PolicyTrainer(
            copy.deepcopy(base), pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3, max_grad_norm=None
        )
        results.append(step_gradients(trainer, samples, settings, counts))
    (all_metrics, all_grads), (batch_metrics, batch_grads), (_, trained_grads) = results
    assert batch_metrics["loss"] == pytest.approx(all_metrics["loss"], rel=1e-5, abs=1e-7)
    assert batch_metrics["grad_norm"] == pytest.approx(all_metrics["grad_norm"], rel=1e-4)
    for name, grad in all_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(batch_grads[name], grad, rtol=1e-4, atol=1e-5 * scale + 1e-9, msg=name)
    # Counting only the trained samples scales the gradient up by the ratio of the counts.
    every, trained = LossCounts.of(signal + zero), LossCounts.of(signal)
    want = (
        every.tokens / trained.tokens if aggregation == "token_mean" else every.sequences / trained.sequences
    )
    assert want > 1.2
    for name, grad in all_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            trained_grads[name], grad * want, rtol=1e-4, atol=1e-5 * scale * want + 1e-9
        )


@pytest.mark.parametrize(
    ("normalizer", "want"), [("trained_groups", LossCounts(14, 4)), ("batch_groups", LossCounts(30, 8))]
)
def test_a_step_hands_its_counts_to_the_trainer(normalizer, want):
    class Recorder:
        def grpo_step(self, samples, settings, counts):
            self.counts = counts
            return {"loss": 0.0}

    trainer = Recorder()
    metrics = train_on_groups(config(loss_normalizer=normalizer), GROUPS, trainer)
    assert trainer.counts == want and metrics["trained_groups"] == 2
