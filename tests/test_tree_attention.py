"""Attention over a prefix tree's segments: the dense block mask's outputs and gradients, for fewer
scores; the trainer uses it on a CPU, and falls back to the dense mask where it cannot."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from prefix_tree_samples import episodes, step_gradients
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from cookbook_lib.grpo import tree_attention
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.shared_prefix import build_prefix_tree
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.grpo.tree_attention import TreeSegments, segmented_attention


def _qkv(length: int, heads: int, kv_heads: int, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def tensor(h: int) -> torch.Tensor:
        return torch.randn((1, h, length, dim), generator=generator, dtype=torch.float64).requires_grad_()

    return tensor(heads), tensor(kv_heads), tensor(kv_heads)


def _grads(output: torch.Tensor, inputs, seed: int = 1) -> list[torch.Tensor]:
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return list(torch.autograd.grad((output * weights).sum(), inputs))


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (6, 1)])
def test_segments_give_the_dense_masks_outputs_and_gradients(heads, kv_heads):
    # The samples hold a shared system prompt, two groups, a duplicate and a prefix of another.
    tree = build_prefix_tree(episodes(vocab=100, seed=2))
    segments = TreeSegments.from_tensors(tree.segments_S3, tree.segment_keys_K)
    length = tree.num_tokens
    # Every packed position is the query of exactly one segment, in order.
    assert segments.starts[0] == 0 and sum(segments.lengths) == length
    ends = [start + n for start, n in zip(segments.starts, segments.lengths, strict=True)]
    assert ends[:-1] == list(segments.starts[1:])
    assert segments.masks[0] is None  # the first sample's segment is its whole self: plain causal
    assert len(segments.starts) < len(episodes(vocab=100, seed=2))  # duplicate and prefix add none
    query, key, value = _qkv(length, heads, kv_heads)
    dense = F.scaled_dot_product_attention(
        query,
        key.repeat_interleave(heads // kv_heads, 1),
        value.repeat_interleave(heads // kv_heads, 1),
        attn_mask=tree.ancestors_LL,
        scale=0.3,
    )
    split = segmented_attention(query, key, value, segments, scaling=0.3)
    torch.testing.assert_close(split, dense, rtol=1e-10, atol=1e-10)
    for got, want in zip(_grads(split, (query, key, value)), _grads(dense, (query, key, value)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # The point: the segments score about a quarter of the pairs the dense mask does.
    scored = sum(n * int(k.numel()) for n, k in zip(segments.lengths, segments.key_index, strict=True))
    assert scored < 0.6 * length * length


@pytest.mark.parametrize("under_autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_segments_attend_in_float32_on_a_cpu(dtype, under_autocast):
    # bf16's CPU backward compiles a oneDNN kernel per block shape; float32's goes to MKL. The
    # trainer calls it under autocast with float32 queries (the rotary embedding promotes them),
    # which SDPA alone would cast down.
    tree = build_prefix_tree(episodes(vocab=100, seed=2))
    segments = TreeSegments.from_tensors(tree.segments_S3, tree.segment_keys_K)
    wide = [tensor.detach().to(dtype).float() for tensor in _qkv(tree.num_tokens, 4, 2)]
    given = [tensor.to(torch.float32 if under_autocast else dtype).requires_grad_() for tensor in wide]
    upcast = [tensor.clone().requires_grad_() for tensor in wide]
    with torch.autocast("cpu", dtype=dtype, enabled=under_autocast):
        got = segmented_attention(*given, segments, scaling=0.3)
    want = segmented_attention(*upcast, segments, scaling=0.3)
    assert got.dtype == dtype and want.dtype == torch.float32
    torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad((got * weights).sum(), given)
    upcast_grads = torch.autograd.grad((want * weights.float()).sum(), upcast)
    for grad, upcast_grad, tensor in zip(grads, upcast_grads, given, strict=True):
        assert grad.dtype == tensor.dtype
        torch.testing.assert_close(grad, upcast_grad.to(tensor.dtype), rtol=0, atol=0)


def test_a_single_sample_is_one_causal_segment():
    tree = build_prefix_tree(episodes(vocab=100)[:1])
    segments = TreeSegments.from_tensors(tree.segments_S3, tree.segment_keys_K)
    assert segments.starts == (0,) and segments.lengths == (tree.num_tokens,) and segments.masks == (None,)


@pytest.fixture
def count_segmented_calls(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return segmented_attention(*args, **kwargs)

    monkeypatch.setattr(tree_attention, "segmented_attention", counted)
    return calls


@pytest.mark.parametrize(("use_lora", "checkpointing"), [(False, False), (False, True), (True, True)])
def test_the_trainer_attends_over_segments_with_the_dense_masks_gradients(
    tiny_model_and_tokenizer, count_segmented_calls, use_lora, checkpointing
):
    base, tokenizer = tiny_model_and_tokenizer
    samples = episodes(vocab=len(tokenizer), seed=4)
    results = {}
    for segmented in (False, True):
        torch.manual_seed(0)
        model = copy.deepcopy(base)
        model.config._attn_implementation = "sdpa"
        trainer = PolicyTrainer(
            model,
            pad_token_id=tokenizer.pad_token_id,
            learning_rate=1e-3,
            use_lora=use_lora,
            activation_checkpointing=checkpointing,
            micro_batch_tokens=4096,
        )
        assert trainer.packs_prefix_trees and trainer.segmented_tree_attention
        trainer.segmented_tree_attention = segmented
        count_segmented_calls.clear()
        results[segmented] = step_gradients(trainer, samples, LossSettings())
        # One tree, every layer; the checkpointed forward runs again in the backward pass, and the
        # keyword must reach the layers there too.
        layers = base.config.num_hidden_layers
        assert len(count_segmented_calls) == (layers * (2 if checkpointing else 1) if segmented else 0)
    (dense_metrics, dense_grads), (split_metrics, split_grads) = results[False], results[True]
    for key in ("loss", "entropy", "grad_norm"):
        assert split_metrics[key] == pytest.approx(dense_metrics[key], rel=1e-5, abs=1e-7), key
    assert dense_grads.keys() == split_grads.keys() and dense_grads
    for name, grad in dense_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-5 * scale + 1e-9, msg=name)


def test_eager_attention_and_padded_rows_never_see_segments(tiny_model_and_tokenizer, count_segmented_calls):
    base, tokenizer = tiny_model_and_tokenizer
    for attention, shared in (("eager", True), ("sdpa", False)):
        model = copy.deepcopy(base)
        model.config._attn_implementation = attention
        trainer = PolicyTrainer(
            model, pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3, shared_prefix=shared
        )
        assert not trainer.segmented_tree_attention
        trainer.grpo_step(episodes(vocab=len(tokenizer), seed=1), LossSettings())
    assert count_segmented_calls == []


def test_calls_without_segments_go_to_transformers_own_sdpa():
    query, key, value = _qkv(12, 4, 2)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.5)
    got, weights = tree_attention._sdpa_or_segments(module, query, key, value, None, scaling=0.5)
    assert weights is None
    torch.testing.assert_close(got, want)


def test_another_registered_sdpa_is_left_in_place(tiny_model_and_tokenizer):
    base, tokenizer = tiny_model_and_tokenizer
    assert tree_attention.install()  # idempotent: the trainer of an earlier test installed it
    assert ALL_ATTENTION_FUNCTIONS.get("sdpa") is tree_attention._sdpa_or_segments

    def someone_elses_sdpa(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa", someone_elses_sdpa)
    try:
        assert not tree_attention.install()
        assert ALL_ATTENTION_FUNCTIONS.get("sdpa") is someone_elses_sdpa
        trainer = PolicyTrainer(copy.deepcopy(base), pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3)
        # The tree still trains, on its dense mask alone.
        assert trainer.packs_prefix_trees and not trainer.segmented_tree_attention
        metrics = trainer.grpo_step(episodes(vocab=len(tokenizer), seed=1), LossSettings())
        assert torch.isfinite(torch.tensor(metrics["loss"]))
    finally:
        AttentionInterface.register("sdpa", tree_attention._sdpa_or_segments)
