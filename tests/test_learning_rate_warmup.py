"""The learning-rate warm-up (``GRPOConfig.warmup_steps``): each update's rate, what the weights
do under it, and a resumed run continuing it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from sft_sequences import two_sft_sequences
from test_grpo_train import run_single_turn, tiny_config

from cookbook_lib.grpo.trainer import PolicyTrainer

LEARNING_RATE = 1e-3


def trainer_of(model, warmup_steps: int) -> PolicyTrainer:
    return PolicyTrainer(
        copy.deepcopy(model), pad_token_id=2, learning_rate=LEARNING_RATE, warmup_steps=warmup_steps
    )


def largest_move(before: dict[str, torch.Tensor], model) -> float:
    return max(float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters())


@pytest.mark.parametrize("warmup_steps", [0, 1, 3])
def test_each_update_takes_its_share_of_the_learning_rate(tiny_model_and_tokenizer, warmup_steps):
    trainer = trainer_of(tiny_model_and_tokenizer[0], warmup_steps)
    rates = [trainer.sft_step(two_sft_sequences())["learning_rate"] for _ in range(4)]
    shares = [min(1.0, k / warmup_steps) if warmup_steps else 1.0 for k in (1, 2, 3, 4)]
    assert rates == pytest.approx([LEARNING_RATE * share for share in shares])
    assert trainer.updates_taken() == 4


def test_the_first_update_moves_the_weights_by_the_warmed_up_rate(tiny_model_and_tokenizer):
    # AdamW's first update moves each weight by about lr * sign(gradient): the warm-up's third.
    moves = {}
    for warmup_steps in (0, 3):
        trainer = trainer_of(tiny_model_and_tokenizer[0], warmup_steps)
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.sft_step(two_sft_sequences())
        moves[warmup_steps] = largest_move(before, trainer.model)
    assert moves[0] == pytest.approx(LEARNING_RATE, rel=0.01)
    assert moves[3] == pytest.approx(LEARNING_RATE / 3, rel=0.01)


def test_a_trainer_given_a_saved_optimizer_state_continues_the_warm_up(tiny_model_and_tokenizer):
    first = trainer_of(tiny_model_and_tokenizer[0], warmup_steps=4)
    for _ in range(2):
        first.sft_step(two_sft_sequences())
    second = trainer_of(tiny_model_and_tokenizer[0], warmup_steps=4)
    second.model.load_state_dict(first.model.state_dict())
    second.optimizer.load_state_dict(first.optimizer.state_dict())
    assert second.updates_taken() == 2
    assert second.sft_step(two_sft_sequences())["learning_rate"] == pytest.approx(LEARNING_RATE * 3 / 4)


def test_a_resumed_run_continues_the_warm_up_where_it_stopped(tiny_model_dir, tmp_path):
    config = tiny_config(
        tiny_model_dir, tmp_path, num_steps=2, warmup_steps=6, validation_interval=0, checkpoint_interval=1
    )
    first = run_single_turn(config).metrics
    extended = run_single_turn(dataclasses.replace(config, num_steps=4)).metrics
    assert extended[:3] == first
    rates = [m["train/learning_rate"] for m in extended[1:] if "train/learning_rate" in m]
    assert len(rates) >= 3  # the tiny model's groups mostly differ; a step without signal takes no update
    expected = [config.learning_rate * k / 6 for k in range(1, len(rates) + 1)]
    assert rates == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"warmup_steps: 6 in the run, 2 now"):
        run_single_turn(dataclasses.replace(config, num_steps=5, warmup_steps=2))
