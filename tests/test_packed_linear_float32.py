"""Prepacked float32 linears (runtime/packed_linear.py): packed where the trainer's linears run in oneDNN.

On CPUs where MKL's sgemm is slow (AMD), the trainer's float32 linears go to oneDNN
(runtime/onednn_linear.py) and a sampling copy's float32 linears are packed for it. These tests
turn that choice on (``COOKBOOK_ONEDNN_LINEAR=1``) so they run on any CPU whose torch build packs
float32 weights, and check the packed copy against the plain model under oneDNN and under MKL.
"""

from __future__ import annotations

import copy

import pytest
import torch
from reply_logprobs import chosen_logprobs

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.generators.handoff import check_state_dict
from cookbook_lib.runtime import onednn_linear, packed_linear
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.onednn_linear import OneDnnLinears
from cookbook_lib.runtime.packed_linear import (
    PackedLinear,
    PackedPart,
    load_weights,
    pack_linears,
    packed_dtypes,
    packed_layers,
    packs,
)

pytestmark = [
    pytest.mark.skipif(
        not (packs(torch.float32) and onednn_linear.onednn_linear_works()),
        reason="this torch build cannot pack float32 weights for oneDNN",
    ),
    pytest.mark.usefixtures("onednn_linear_on"),  # conftest: oneDNN chosen, as on AMD
]

# Float32 sums in another order (oneDNN's against MKL's, or a matrix-vector kernel at one row).
LOGIT_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def _copy(model):
    return copy.deepcopy(model).eval()


def _logits(model, tokens: list[int], onednn: bool = False) -> torch.Tensor:
    with torch.inference_mode(), OneDnnLinears() if onednn else torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits


def test_float32_packs_only_where_the_trainers_linears_run_in_onednn(sharp_model, monkeypatch):
    assert torch.float32 in packed_dtypes()
    model = _copy(sharp_model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert pack_linears(model) == len(packed_layers(model)) == len(linears) > 0
    monkeypatch.setattr(packed_linear, "onednn_linear_chosen", lambda: False)
    assert torch.float32 not in packed_dtypes()
    assert pack_linears(_copy(sharp_model)) == 0
    monkeypatch.setattr(packed_linear, "onednn_linear_chosen", lambda: True)
    monkeypatch.setenv(packed_linear.SWITCH_VARIABLE, "0")
    assert pack_linears(_copy(sharp_model)) == 0


def test_a_packed_float32_model_gives_the_plain_models_logits(sharp_model, prompts):
    packed = _copy(sharp_model)
    pack_linears(packed)
    assert not any(name in packed.state_dict() for name in packed_layers(packed))  # no second copy
    for prompt in prompts:
        ours = _logits(packed, prompt)
        torch.testing.assert_close(ours, _logits(sharp_model, prompt, onednn=True), **LOGIT_TOLERANCE)
        torch.testing.assert_close(ours, _logits(sharp_model, prompt), **LOGIT_TOLERANCE)


@pytest.mark.parametrize("rows", [2, 16, 40])
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
def test_at_the_embedded_models_shapes_packed_equals_the_plain_onednn_linear_bit_for_bit(shape, rows):
    """The kernel the trainer's forward runs, on the same sums: a sampled token's log-prob is the
    trainer's, not just close to it (one row is the exception: a matrix-vector kernel)."""
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(shape[1], shape[0], bias=True)
    x = torch.randn(rows, 1, shape[1], generator=generator)
    with torch.inference_mode():
        with OneDnnLinears():
            expected = linear(x)
        assert torch.equal(PackedLinear(linear)(x), expected)


@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (49152, 576)])
def test_a_lone_row_computes_what_it_computes_in_a_batch(shape):
    """A decode step whose other rows have finished: bit for bit the row's numbers in the batch (the
    one-row kernel sums in its own order, at 576x1536 even from a packed weight on an AVX-512 Xeon)."""
    generator = torch.Generator().manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(shape[1], shape[0], bias=True))
    batch = torch.randn(16, 1, shape[1], generator=generator)
    with torch.inference_mode():
        together = layer(batch)
        for row in (0, 7, 15):
            assert torch.equal(layer(batch[row : row + 1]), together[row : row + 1])
        assert torch.equal(layer(batch[3]), together[3])  # [1, hidden]: the same, in its own shape


def test_sibling_projections_are_packed_together_in_float32(sharp_model):
    model = _copy(sharp_model)
    pack_linears(model)
    attention = model.model.layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    assert all(isinstance(p, PackedPart) for p in (q, k, v)) and q.group is k.group is v.group
    assert q.group.dtype == torch.float32


def test_a_float32_weight_update_repacks_and_matches_a_plain_copy_loaded_alike(sharp_model, sharpen, prompts):
    packed, plain = _copy(sharp_model), _copy(sharp_model)
    pack_linears(packed)
    trained = sharpen(sharp_model, seed=7).state_dict()
    check_state_dict(packed, trained)
    load_weights(packed, trained)
    load_weights(plain, trained)
    updated = _logits(packed, prompts[2])
    torch.testing.assert_close(updated, _logits(plain, prompts[2], onednn=True), **LOGIT_TOLERANCE)
    assert (updated - _logits(sharp_model, prompts[2])).abs().max() > 1.0


def test_a_generator_owning_a_float32_copy_packs_it_and_samples_what_the_plain_model_scores(
    sharp_model, sharpen, tokenizer, prompts
):
    trained = sharpen(sharp_model, seed=5)

    async def sample() -> tuple[list, list]:
        generator = HFGenerator(_copy(sharp_model), pad_token_id=tokenizer.pad_token_id, pack_weights=True)
        assert packed_layers(generator.model)
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
        async with generator:
            before = [await generator.sample(p, params) for p in prompts]
            await generator.update_weights(trained.state_dict(), version=1)
            after = [await generator.sample(p, params) for p in prompts]
        return before, after

    before, after = run_sync(sample())
    for model, results in ((sharp_model, before), (trained, after)):
        for prompt, result in zip(prompts, results, strict=True):
            expected = chosen_logprobs(model, prompt, result.tokens)
            sampled = torch.tensor(result.logprobs, dtype=torch.float64)
            torch.testing.assert_close(sampled, expected, atol=1e-3, rtol=0.0)
    assert [r.tokens for r in before] != [r.tokens for r in after]  # the update reached the packed layers


def test_a_generator_on_a_model_it_does_not_own_leaves_it_trainable(sharp_model, tokenizer):
    model = _copy(sharp_model)
    HFGenerator(model, pad_token_id=tokenizer.pad_token_id)  # pack_weights defaults to False
    assert not packed_layers(model)
    assert all(p.requires_grad for p in model.parameters())
