"""Shared fixtures. Tiny random models are session-scoped: building one takes a second or two."""

from __future__ import annotations

import os

import pytest

# W&B never reaches the network from the tests.
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer():
    from cookbook_lib.models import tiny_random_model

    return tiny_random_model(seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]
