"""Trainable weights loaded from a mapped safetensors file get memory of their own before training."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.runtime.file_mapped import copy_file_mapped_parameters, in_a_mapped_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


@pytest.fixture
def mapped_model(tiny_model_and_tokenizer, tmp_path):
    model, _ = tiny_model_and_tokenizer
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    # The premise: transformers maps the file and the weights point into it.
    assert all(in_a_mapped_file(p) for p in loaded.parameters())
    return loaded


def test_trainable_weights_are_copied_out_of_the_file(mapped_model):
    values = {name: p.detach().clone() for name, p in mapped_model.named_parameters()}
    parameters = {name: p for name, p in mapped_model.named_parameters()}
    total = sum(p.numel() * p.element_size() for p in mapped_model.parameters())
    assert copy_file_mapped_parameters(mapped_model) == total
    for name, parameter in mapped_model.named_parameters():
        assert not in_a_mapped_file(parameter), name
        assert parameter is parameters[name]  # the same Parameter objects: optimizers, ties hold
        assert torch.equal(parameter, values[name]), name
    assert mapped_model.get_output_embeddings().weight is mapped_model.get_input_embeddings().weight
    assert copy_file_mapped_parameters(mapped_model) == 0  # nothing left to copy


def test_frozen_weights_stay_in_the_file(mapped_model):
    embeddings = mapped_model.get_input_embeddings().weight
    embeddings.requires_grad_(False)
    copied = copy_file_mapped_parameters(mapped_model)
    assert in_a_mapped_file(embeddings)
    assert copied == sum(p.numel() * p.element_size() for p in mapped_model.parameters() if p.requires_grad)


def test_the_trainer_trains_weights_of_its_own(mapped_model, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    trainer = PolicyTrainer(mapped_model, pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3)
    assert not any(in_a_mapped_file(p) for p in trainer.model.parameters())
    # The optimizer holds the model's own Parameter objects, whose data is now the copies.
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in trainer.model.parameters()}
