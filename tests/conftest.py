"""Shared fixtures. Tiny random models are session-scoped: building one takes a second or two."""

from __future__ import annotations

import copy
import os

import pytest

# W&B never reaches the network from the tests.
os.environ.setdefault("WANDB_MODE", "offline")
TEST_ONLY_SETTINGS = {
    # A fixed thread count: a count fitted to a shared machine's free cores (runtime.cpu_share) changes
    # float rounding, and the resume tests compare weights bit for bit. tests/test_cpu_share.py tests it.
    "COOKBOOK_FIT_THREADS": "0",
    # dtype="auto" picks bf16 on a CPU whose bf16 matmuls measure faster (runtime.devices); the tests
    # compare log-probs, losses and resumed weights to float32's tolerances, on whatever CPU runs them,
    # so "auto" keeps float32 here. tests/test_cpu_probe.py tests the choice.
    "COOKBOOK_CPU_BF16": "0",
}
# The notebooks take the library's real defaults, as a user's kernel does, even when nbmake runs them
# in this process after the tests: ../conftest.py takes the settings this file made (not those the
# user set) out of the environment while a notebook runs. Named here for it to read.
set_here = [name for name in TEST_ONLY_SETTINGS if name not in os.environ]
os.environ["COOKBOOK_TEST_ONLY_SETTINGS"] = ",".join(set_here)
for name, value in TEST_ONLY_SETTINGS.items():
    os.environ.setdefault(name, value)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer():
    from cookbook_lib.runtime.models import tiny_random_model

    return tiny_random_model(seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


def _sharpen(model, seed: int):
    """A copy of ``model`` with larger random weights: peaked next-token distributions, as a
    trained model has, so sampling tests see likely and unlikely tokens, not a uniform spread."""
    import torch

    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.fixture(scope="session")
def sharpen():
    """``sharpen(model, seed)``, for tests that need more such models."""
    return _sharpen


@pytest.fixture(scope="module")
def sharp_model(tiny_model_and_tokenizer):
    return _sharpen(tiny_model_and_tokenizer[0], seed=1)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Four prompts of different lengths, for the generator tests."""
    texts = ["Hi", "What is two plus two?", "Tell me a story about a dog and a ball, please.", "ok ok"]
    return [tokenizer.encode(text) for text in texts]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random model saved like any local model, so configs can name it."""
    from cookbook_lib.runtime.models import tiny_random_model

    model, tokenizer = tiny_random_model(seed=0, embedding_scale=10.0)
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def sliding_model(sharpen):
    """A tiny model whose layers attend within a sliding window: its cache keeps only the last
    keys, so rows cannot be kept for prefix reuse nor put in fixed-shape slots."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    torch.manual_seed(0)
    return sharpen(AutoModelForCausalLM.from_config(config), seed=3)


@pytest.fixture
def onednn_linear_on(monkeypatch):
    """oneDNN's float32 linear chosen, as on an AMD CPU, whatever this CPU measured."""
    from cookbook_lib.runtime import onednn_linear

    monkeypatch.setenv(onednn_linear.SWITCH_VARIABLE, "1")
    onednn_linear.onednn_linear_chosen.cache_clear()
    yield
    onednn_linear.onednn_linear_chosen.cache_clear()
