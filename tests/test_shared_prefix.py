"""Shared-prefix training: the prefix tree, its packing, and the same loss and gradients as padding."""

from __future__ import annotations

import copy

import pytest
import torch
from prefix_tree_samples import episodes, step_gradients

from cookbook_lib.grpo import trainer as trainer_module
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.samples import collate
from cookbook_lib.grpo.shared_prefix import (
    build_prefix_tree,
    pack_shared_micro_batches,
    packed_length,
    tree_attention_unsupported,
)
from cookbook_lib.grpo.trainer import PolicyTrainer


def test_the_tree_holds_each_prefix_once_and_gives_every_sample_its_own_row():
    samples = episodes(vocab=100)
    tree = build_prefix_tree(samples)
    assert tree.num_tokens == packed_length(samples)
    assert tree.num_tokens < sum(len(s) - 1 for s in samples)
    batch = collate(samples, pad_token_id=0)
    for b, sample in enumerate(samples):
        n = len(sample) - 1
        index_T = tree.index_BT[b, :n]
        assert tree.input_ids_L[index_T].tolist() == sample.tokens_T[:-1]
        assert tree.position_ids_L[index_T].tolist() == list(range(n))
        # Row t of the sample attends to its tokens 0..t, through the tree.
        rows = tree.ancestors_LL[index_T][:, index_T]
        assert torch.equal(rows, torch.ones(n, n, dtype=torch.bool).tril())
        # ...and to nothing else: every column it may see is one of its own tokens.
        assert int(tree.ancestors_LL[index_T].sum()) == n * (n + 1) // 2
        assert torch.equal(tree.input_ids_L[index_T], batch["input_ids"][b, :n])
    # The system prompt is forwarded once for all eight samples.
    assert int((tree.position_ids_L == 0).sum()) == 1


def test_packing_keeps_shared_prefixes_together_within_the_budget():
    samples = episodes(vocab=100)
    longest = max(len(s) - 1 for s in samples)
    for budget in (longest, longest + 20, 10_000):
        batches = pack_shared_micro_batches(samples, budget)
        assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
        assert all(packed_length(b) <= budget for b in batches)
    assert len(pack_shared_micro_batches(samples, 10_000)) == 1
    with pytest.raises(ValueError, match="token_budget"):
        pack_shared_micro_batches(samples, 0)


def test_models_that_cannot_take_a_block_mask_are_named_with_why(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    assert tree_attention_unsupported(model.config) is None
    config = copy.deepcopy(model.config)
    config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in tree_attention_unsupported(config)
    config = copy.deepcopy(model.config)
    config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding_attention" in tree_attention_unsupported(config)


@pytest.mark.parametrize(
    ("use_lora", "checkpointing", "attention", "kl_coef"),
    [
        (False, False, "sdpa", 0.0),
        (False, True, "sdpa", 0.0),
        (True, False, "sdpa", 0.05),
        (True, True, "eager", 0.0),
        (False, False, "eager", 0.0),
    ],
)
def test_same_loss_and_gradients_as_padded_rows(
    tiny_model_and_tokenizer, use_lora, checkpointing, attention, kl_coef, monkeypatch
):
    base, tokenizer = tiny_model_and_tokenizer
    samples = episodes(vocab=len(tokenizer), seed=3)
    settings = LossSettings(kl_coef=kl_coef)
    results = {}
    for shared in (False, True):
        # The tree arm also runs its LM head in chunks of 7 positions (the padded one in one):
        # the chunks' recomputed backward must add up to the same gradients.
        monkeypatch.setattr(trainer_module, "HEAD_CHUNK_ROWS", 7 if shared else 10_000)
        torch.manual_seed(0)
        model = copy.deepcopy(base)
        model.config._attn_implementation = attention
        trainer = PolicyTrainer(
            model,
            pad_token_id=tokenizer.pad_token_id,
            learning_rate=1e-3,
            use_lora=use_lora,
            activation_checkpointing=checkpointing,
            shared_prefix=shared,
            micro_batch_tokens=4096,
        )
        assert (trainer.shared_prefix_unsupported is None) == shared
        results[shared] = step_gradients(trainer, samples, settings)
    (padded_metrics, padded_grads), (tree_metrics, tree_grads) = results[False], results[True]
    assert tree_metrics["forwarded_tokens"] < 0.6 * padded_metrics["forwarded_tokens"]
    for key in ("loss", "entropy", "trained_tokens", "grad_norm"):
        assert tree_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-4, abs=1e-6), key
    assert padded_grads.keys() == tree_grads.keys() and padded_grads
    assert padded_metrics["grad_norm"] > 1e-3  # a gradient worth comparing
    for name, grad in padded_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(tree_grads[name], grad, rtol=1e-3, atol=1e-4 * scale + 1e-9, msg=name)


def test_the_sft_warm_start_trains_the_same_on_the_tree(tiny_model_and_tokenizer):
    from cookbook_lib.rollout.episode import TokenSequence

    base, tokenizer = tiny_model_and_tokenizer
    samples = episodes(vocab=len(tokenizer), seed=5)
    sequences = [
        TokenSequence(
            tokens_T=s.tokens_T,
            assistant_mask_T=s.loss_mask_T,
            sampling_logprobs_T=s.sampling_logprobs_T,
            policy_versions_T=s.policy_versions_T,
        )
        for s in samples
    ]
    results = {}
    for shared in (False, True):
        trainer = PolicyTrainer(
            copy.deepcopy(base), pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3, shared_prefix=shared
        )
        captured = {}
        trainer.optimizer.step = lambda captured=captured, trainer=trainer: captured.update(
            {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        )
        results[shared] = (trainer.sft_step(sequences), captured)
    assert results[True][0]["sft_loss"] == pytest.approx(results[False][0]["sft_loss"], rel=1e-5)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
