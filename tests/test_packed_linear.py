"""Prepacked bf16 linears (runtime/packed_linear.py): ``F.linear``'s numbers, loaded like the model's."""

from __future__ import annotations

import copy

import pytest
import torch
from reply_logprobs import chosen_logprobs

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.generators.handoff import check_state_dict
from cookbook_lib.runtime import packed_linear
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.devices import Float32Head, Precision, sampling_copy
from cookbook_lib.runtime.packed_linear import (
    PackedLinear,
    PackedPart,
    load_weights,
    pack_linears,
    packed_layers,
    packs,
    weight_shapes,
)

pytestmark = pytest.mark.skipif(
    not packs(torch.bfloat16), reason="this torch build cannot pack bf16 weights on this CPU"
)


def _bf16(model):
    return copy.deepcopy(model).to(torch.bfloat16).eval()


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits


# bf16 logits of the tiny model: oneDNN's packed kernel and F.linear's (for such small layers not
# oneDNN's) round some outputs apart, so a logit may move by a bf16 step.
LOGIT_TOLERANCE = {"atol": 0.1, "rtol": 0.02}


def test_a_packed_model_computes_the_same_logits_and_keeps_no_plain_weight(sharp_model, prompts):
    plain = _bf16(sharp_model)
    packed = _bf16(sharp_model)
    swapped = pack_linears(packed)
    layers = packed_layers(packed)
    linears = [m for m in plain.modules() if type(m) is torch.nn.Linear]
    assert swapped == len(layers) == len(linears) > 0
    # The plain weights are gone from the model: no second copy of the linears' memory.
    assert not any(name in packed.state_dict() for name in layers)
    for prompt in prompts:
        torch.testing.assert_close(_logits(packed, prompt), _logits(plain, prompt), **LOGIT_TOLERANCE)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (192, 576)])
def test_at_the_embedded_models_shapes_packed_equals_f_linear_bit_for_bit(shape, rows):
    """Where F.linear's bf16 matmul is oneDNN's too (these sizes), the same kernel gives the same sums."""
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 1, shape[1], generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x)
        assert torch.equal(PackedLinear(linear)(x), expected)


def test_float32_models_and_the_switch_pack_nothing(sharp_model, monkeypatch):
    # Float32 packs only where the trainer's float32 linears run in oneDNN (test_packed_linear_float32).
    monkeypatch.setattr(packed_linear, "onednn_linear_chosen", lambda: False)
    model = copy.deepcopy(sharp_model)
    assert pack_linears(model) == 0 and not packed_layers(model)
    monkeypatch.setenv(packed_linear.SWITCH_VARIABLE, "0")
    model = _bf16(sharp_model)
    assert pack_linears(model) == 0 and not packed_layers(model)


def test_a_weight_update_repacks_and_matches_a_plain_copy_loaded_alike(sharp_model, sharpen, prompts):
    """The trainer's float32 state dict (tied names and all) reaches packed and plain layers alike."""
    packed = _bf16(sharp_model)
    pack_linears(packed)
    plain = _bf16(sharp_model)
    trained = sharpen(sharp_model, seed=7).state_dict()
    check_state_dict(packed, trained)  # packed weights answer under their nn.Linear names
    load_weights(packed, trained)
    load_weights(plain, trained)  # no packed layers: every tensor copied in place
    updated = _logits(packed, prompts[2])
    torch.testing.assert_close(updated, _logits(plain, prompts[2]), **LOGIT_TOLERANCE)
    assert (updated - _logits(_bf16(sharp_model), prompts[2])).abs().max() > 1.0


def test_a_packed_weight_of_the_wrong_shape_is_refused_before_loading(sharp_model):
    packed = _bf16(sharp_model)
    pack_linears(packed)
    name, layer = next(iter(packed_layers(packed).items()))
    assert weight_shapes(packed)[name] == layer.weight_shape
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        check_state_dict(packed, {name: torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="shape"):
        layer.load(torch.zeros(3, 5))


def test_only_plain_linears_are_packed():
    class Scaled(torch.nn.Linear):  # a subclass does more than a matmul (LoRA, quantised layers)
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Scaled(8, 8), torch.nn.Linear(8, 4, bias=True))
    model = model.to(torch.bfloat16)
    x = torch.randn(3, 8).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], Scaled)
    assert isinstance(model[2].bias, torch.nn.Parameter)  # the bias stays in the state dict
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


def test_a_generator_with_packed_weights_samples_what_the_plain_model_scores(
    sharp_model, sharpen, tokenizer, prompts
):
    """Sampled before and after a weight update, each reply's log-probs are the plain model's."""
    trained = sharpen(sharp_model, seed=5)

    async def sample() -> tuple[list, list]:
        generator = HFGenerator(_bf16(sharp_model), pad_token_id=tokenizer.pad_token_id, pack_weights=True)
        assert packed_layers(generator.model)
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
        async with generator:
            before = [await generator.sample(p, params) for p in prompts]
            await generator.update_weights(trained.state_dict(), version=1)
            after = [await generator.sample(p, params) for p in prompts]
        return before, after

    before, after = run_sync(sample())
    for model, results in ((_bf16(sharp_model), before), (_bf16(trained), after)):
        for prompt, result in zip(prompts, results, strict=True):
            expected = chosen_logprobs(model, prompt, result.tokens)
            sampled = torch.tensor(result.logprobs, dtype=torch.float64)
            torch.testing.assert_close(sampled, expected, atol=0.15, rtol=0.0)
    assert [r.tokens for r in before] != [r.tokens for r in after]  # the update reached the packed layers


def test_a_sampling_copys_float32_head_is_packed_in_float32(sharp_model, sharpen, prompts):
    precision = Precision(torch.device("cpu"), torch.bfloat16, torch.bfloat16)
    packed, plain = sampling_copy(sharp_model, precision), sampling_copy(sharp_model, precision)
    assert isinstance(plain.get_output_embeddings(), Float32Head)
    pack_linears(packed)
    head = packed.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.dtype == torch.float32
    logits = _logits(packed, prompts[2])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _logits(plain, prompts[2]), **LOGIT_TOLERANCE)
    trained = sharpen(sharp_model, seed=9).state_dict()
    load_weights(packed, trained)
    load_weights(plain, trained)
    torch.testing.assert_close(_logits(packed, prompts[2]), _logits(plain, prompts[2]), **LOGIT_TOLERANCE)


def test_a_lockstep_copy_shares_the_trained_float32_head_and_leaves_it_unpacked(sharp_model, prompts):
    precision = Precision(torch.device("cpu"), torch.bfloat16, torch.bfloat16)
    trained = copy.deepcopy(sharp_model)
    shared = sampling_copy(trained, precision, share_head=True)
    own = sampling_copy(trained, precision)
    assert shared.get_output_embeddings().weight is trained.get_output_embeddings().weight
    assert torch.equal(_logits(shared, prompts[1]), _logits(own, prompts[1]))
    pack_linears(shared)
    assert isinstance(shared.get_output_embeddings(), Float32Head)  # no packed copy of it
    load_weights(shared, trained.state_dict())  # the head's own tensor: nothing to copy
    with torch.no_grad():  # an optimizer step on the trained model reaches the shared head at once
        trained.get_output_embeddings().weight.mul_(2)
    torch.testing.assert_close(
        _logits(shared, prompts[1]), 2 * _logits(own, prompts[1]), rtol=1e-4, atol=1e-4
    )


class _Attention(torch.nn.Module):
    """Projections named as a decoder layer's, called as its forward calls them (on the same input)."""

    def __init__(self, width: int = 576, kv: int = 192, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(width, width, bias=bias)
        self.k_proj = torch.nn.Linear(width, kv, bias=bias)
        self.v_proj = torch.nn.Linear(width, kv, bias=bias)
        self.o_proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q + torch.cat([k, v, k], dim=-1))


def _attention(bias: bool = False, seed: int = 0) -> _Attention:
    torch.manual_seed(seed)
    return _Attention(bias=bias).to(torch.bfloat16).eval()


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_projections_of_one_input_are_packed_together_and_give_f_linears_numbers(rows):
    plain = _attention(bias=True)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 4
    q, k, v, o = packed.q_proj, packed.k_proj, packed.v_proj, packed.o_proj
    assert isinstance(o, PackedLinear) and all(isinstance(p, PackedPart) for p in (q, k, v))
    assert q.group is k.group is v.group and q.group.sizes == [576, 192, 192]
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(packed, name)(x), getattr(plain, name)(x)), name
        assert torch.equal(packed(x), plain(x))
    assert q.group._input is None  # every part took its slice: the group holds no output


def test_a_group_reads_back_its_weights_exactly_and_takes_a_partial_update():
    plain = _attention()
    packed = copy.deepcopy(plain)
    pack_linears(packed)
    group = packed.q_proj.group
    joined = torch.cat([plain.q_proj.weight, plain.k_proj.weight, plain.v_proj.weight])
    assert torch.equal(group.unpacked(), joined)
    new_key = torch.randn(192, 576)  # float32, as the trainer sends it
    check_state_dict(packed, {"k_proj.weight": new_key})
    load_weights(packed, {"k_proj.weight": new_key})
    with torch.no_grad():
        plain.k_proj.weight.copy_(new_key)
    x = torch.randn(3, 576).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))
    with pytest.raises(ValueError, match="shape"):
        packed.v_proj.load(torch.zeros(3, 5))


def test_a_groups_biases_follow_a_weight_update():
    plain, trained = _attention(bias=True, seed=0), _attention(bias=True, seed=1)
    packed = copy.deepcopy(plain)
    pack_linears(packed)
    assert {"q_proj.bias", "k_proj.bias", "v_proj.bias"} <= set(packed.state_dict())  # names as before
    load_weights(packed, trained.state_dict())
    x = torch.randn(5, 576).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), trained(x))
        only_bias = {"v_proj.bias": torch.ones(192)}  # a bias alone reaches the joined one too
        load_weights(packed, only_bias)
        load_weights(trained, only_bias)
        assert torch.equal(packed(x), trained(x))


def test_a_part_called_on_another_input_computes_its_own_output():
    plain = _attention()
    packed = copy.deepcopy(plain)
    pack_linears(packed)
    first, second = (torch.randn(2, 576).to(torch.bfloat16) for _ in range(2))
    with torch.inference_mode():
        packed.q_proj(first)  # leaves k and v computed for `first`
        assert torch.equal(packed.k_proj(second), plain.k_proj(second))
        assert torch.equal(packed.q_proj(second), plain.q_proj(second))
        assert torch.equal(packed.q_proj(second), plain.q_proj(second))  # taken twice: computed again
