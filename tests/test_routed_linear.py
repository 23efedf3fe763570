"""Routed linears (runtime/routed_linear.py): oneDNN in a generator's steps, nn.Linear's forward elsewhere."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.runtime import onednn_linear, packed_linear
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.onednn_linear import OneDnnLinears
from cookbook_lib.runtime.routed_linear import (
    RoutedForward,
    release_packed_weights,
    route_linears,
    routed_linears,
)

pytestmark = [
    pytest.mark.skipif(
        not onednn_linear.onednn_linear_works(), reason="this torch build has no oneDNN linear"
    ),
    pytest.mark.usefixtures("onednn_linear_on"),  # conftest: oneDNN chosen, as on AMD
]


@pytest.fixture(params=["packed", "plain"])
def packing(request, monkeypatch) -> bool:
    """Routed layers with their weights packed while sampling (where float32 packs) or plain."""
    if request.param == "plain":
        monkeypatch.setenv(packed_linear.SWITCH_VARIABLE, "0")
    elif not packed_linear.packs(torch.float32):
        pytest.skip("this torch build cannot pack float32 weights on this CPU")
    return request.param == "packed"


@pytest.fixture
def packing_on() -> None:
    if not packed_linear.packs(torch.float32):
        pytest.skip("this torch build cannot pack float32 weights on this CPU")


@pytest.fixture
def onednn_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes of every routed call to oneDNN, from a plain or a packed weight."""
    calls: list[tuple[int, ...]] = []

    def counting(real):
        def call(x, weight, bias):
            calls.append(tuple(x.shape))
            return real(x, weight, bias)

        return call

    for name in ("onednn_linear_forward", "packed_linear_forward"):
        real = getattr(onednn_linear if name.startswith("onednn") else packed_linear, name)
        monkeypatch.setattr(f"cookbook_lib.runtime.routed_linear.{name}", counting(real))
    return calls


def _layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32, bias=False))


def test_inside_the_context_a_routed_layer_computes_what_the_mode_does(onednn_calls, packing):
    layers = _layers()
    assert route_linears(layers) == 2
    x = torch.randn(5, 1, 64)
    with torch.inference_mode():
        with OneDnnLinears():
            expected = layers(x)
        plain = layers(x)  # outside the context: nn.Linear's own forward
        assert onednn_calls == []
        with routed_linears():
            routed = layers(x)
    assert onednn_calls == [(5, 1, 64), (5, 1, 96)]
    assert torch.equal(routed, expected)
    torch.testing.assert_close(plain, routed, rtol=1e-5, atol=1e-5)


def test_with_grad_another_dtype_or_another_thread_the_layer_is_nn_linears(onednn_calls, packing):
    layers = _layers()
    route_linears(layers)
    x = torch.randn(3, 64)
    with routed_linears():
        out = layers(x)  # grad enabled: the trainer's path, with gradients
        out.sum().backward()
        assert layers[0].weight.grad is not None
        with torch.inference_mode():
            layers.to(torch.float64)(x.double())
    assert onednn_calls == []

    seen: list[int] = []

    def other_thread() -> None:
        with torch.inference_mode():
            layers.to(torch.float32)(x)
        seen.append(len(onednn_calls))

    with routed_linears():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == [0]


def test_a_copy_routes_its_own_weights_and_a_pickle_loads(onednn_calls, packing):
    layers = _layers()
    route_linears(layers)
    twin = copy.deepcopy(layers)
    with torch.no_grad():
        twin[0].weight.mul_(2)
    assert isinstance(vars(twin[0])["forward"], RoutedForward)
    assert vars(twin[0])["forward"].layer is twin[0]
    x = torch.randn(4, 64)
    with torch.inference_mode(), routed_linears():
        assert not torch.equal(twin(x), layers(x))
    loaded = pickle.loads(pickle.dumps(layers))
    with torch.inference_mode(), routed_linears():
        assert torch.equal(loaded(x), layers(x))
    assert set(loaded.state_dict()) == set(_layers().state_dict())  # the route is not in the state dict


def test_where_onednn_is_not_chosen_nothing_is_routed(monkeypatch):
    monkeypatch.setenv(onednn_linear.SWITCH_VARIABLE, "0")
    onednn_linear.onednn_linear_chosen.cache_clear()
    layers = _layers()
    assert route_linears(layers) == 0
    assert "forward" not in vars(layers[0])


def test_a_generator_on_a_shared_model_routes_it_samples_through_onednn_and_leaves_it_trainable(
    sharp_model, tokenizer, prompts, onednn_calls, packing
):
    model = copy.deepcopy(sharp_model).eval()
    generator = HFGenerator(model, pad_token_id=tokenizer.pad_token_id)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert all(isinstance(vars(m).get("forward"), RoutedForward) for m in linears)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)

    async def sample():
        async with generator:
            return await generator.sample(prompts[1], params)

    result = run_sync(sample())
    assert onednn_calls  # the worker's prefill and decode steps went to oneDNN
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompts[1] + result.tokens])).logits[0]
    logprobs = torch.log_softmax(logits, -1)[len(prompts[1]) - 1 : -1]
    expected = logprobs.gather(-1, torch.tensor(result.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-3, rtol=0.0)
    # The trainer's thread: gradients through nn.Linear's forward, the same as an unrouted copy's.
    tokens = torch.tensor([prompts[2]])
    loss = model(input_ids=tokens).logits.logsumexp(-1).mean()
    plain = copy.deepcopy(sharp_model)
    expected_loss = plain(input_ids=tokens).logits.logsumexp(-1).mean()
    torch.testing.assert_close(loss, expected_loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_f_linear_outside_a_layer_is_left_alone(onednn_calls, packing):
    with torch.inference_mode(), routed_linears():
        F.linear(torch.randn(2, 8), torch.randn(3, 8))
    assert onednn_calls == []


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (576, 1536), (96, 64)])
def test_a_row_alone_computes_what_it_computes_in_a_batch(shape, packing):
    """A decode step whose other rows have finished gives the row the same numbers, bit for bit."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0])
    route_linears(layer)
    batch = torch.randn(16, 1, shape[1])
    with torch.inference_mode(), routed_linears():
        together = layer(batch)
        for row in (0, 7, 15):
            assert torch.equal(layer(batch[row : row + 1]), together[row : row + 1])
        assert torch.equal(layer(batch[3]), together[3])  # [1, hidden]: the same, in its own shape


def test_a_packed_weight_is_reused_until_the_weight_changes_and_released_on_request(packing_on, monkeypatch):
    packs: list[tuple[int, ...]] = []
    real = packed_linear.pack_weight
    monkeypatch.setattr(
        "cookbook_lib.runtime.routed_linear.pack_weight", lambda w: packs.append(tuple(w.shape)) or real(w)
    )
    layers = _layers()
    route_linears(layers)
    x = torch.randn(4, 64)
    with torch.inference_mode(), routed_linears():
        first = layers(x)
        assert torch.equal(layers(x), first)
    assert packs == [(96, 64), (32, 96)]  # once each, at the first call
    with torch.no_grad():
        layers[2].weight.mul_(2)  # as an optimizer step writes it: in place
    with torch.inference_mode(), routed_linears():
        changed = layers(x)
    assert packs[2:] == [(32, 96)]  # only the changed layer repacks
    torch.testing.assert_close(changed, 2 * first)
    twin = copy.deepcopy(layers)  # a packed weight is not copied, nor pickled: repacked on use
    loaded = pickle.loads(pickle.dumps(layers))
    with torch.inference_mode(), routed_linears():
        assert torch.equal(twin(x), changed) and torch.equal(loaded(x), changed)
    assert release_packed_weights(layers) == 2
    assert release_packed_weights(layers) == 0
    with torch.inference_mode(), routed_linears():
        layers(x)
    packed_so_far = len(packs)
    monkeypatch.setenv(packed_linear.SWITCH_VARIABLE, "0")
    assert route_linears(layers) == 2  # routed again with packing off: plain weights, none kept
    assert [vars(layers[i])["forward"]._packed for i in (0, 2)] == [None, None]
    with torch.inference_mode(), routed_linears():
        # Within rounding: at layers this small oneDNN may pick another kernel for plain weights.
        torch.testing.assert_close(layers(x), changed, rtol=1e-5, atol=1e-5)
    assert len(packs) == packed_so_far


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)])
def test_packed_and_plain_routes_compute_the_same_at_the_embedded_models_shapes(shape, packing_on):
    """Packing while sampling changes no number: each row count from 1 to 16, bit for bit."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    route_linears(layer)
    plain = copy.deepcopy(layer)
    vars(plain)["forward"].pack = False
    batch = torch.randn(16, 1, shape[1])
    with torch.inference_mode(), routed_linears():
        for rows in range(1, 17):
            assert torch.equal(layer(batch[:rows]), plain(batch[:rows])), rows


def test_a_generator_lets_go_of_packed_weights_before_training_and_when_it_closes(
    sharp_model, tokenizer, prompts, packing
):
    model = copy.deepcopy(sharp_model).eval()
    routes = [
        vars(m)["forward"] for m in model.modules() if isinstance(vars(m).get("forward"), RoutedForward)
    ]
    generator = HFGenerator(model, pad_token_id=tokenizer.pad_token_id)
    routes = [
        vars(m)["forward"] for m in model.modules() if isinstance(vars(m).get("forward"), RoutedForward)
    ]
    params = SamplingParams(temperature=0, max_tokens=4)

    async def phases():
        async with generator:
            await generator.sample(prompts[1], params)
            sampled = sum(route._packed is not None for route in routes)
            await generator.sleep()  # the lockstep loop's call before an optimizer step
            slept = sum(route._packed is not None for route in routes)
            await generator.sample(prompts[2], params)
            again = sum(route._packed is not None for route in routes)
        return sampled, slept, again

    sampled, slept, again = run_sync(phases())
    assert routes
    expected = len(routes) if packing else 0
    assert (sampled, slept, again) == (expected, 0, expected)
    assert all(route._packed is None for route in routes)  # closed: the shared model keeps none
