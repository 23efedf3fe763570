"""Linears through oneDNN: F.linear's numbers and gradients, float32 on a CPU, on the entering thread only."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from cookbook_lib.runtime import onednn_linear
from cookbook_lib.runtime.onednn_linear import OneDnnLinears, onednn_linears

needs_onednn = pytest.mark.skipif(
    not onednn_linear.onednn_linear_works(), reason="this torch build has no oneDNN linear"
)


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """Each test chooses anew; oneDNN is on unless a test says otherwise."""
    monkeypatch.setenv(onednn_linear.SWITCH_VARIABLE, "1")
    onednn_linear.onednn_linear_chosen.cache_clear()
    onednn_linear.onednn_linear_works.cache_clear()
    yield
    onednn_linear.onednn_linear_chosen.cache_clear()
    onednn_linear.onednn_linear_works.cache_clear()


@pytest.fixture
def rerouted(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes of every call the mode sent to oneDNN."""
    calls: list[tuple[int, ...]] = []
    real = onednn_linear.onednn_linear_forward
    onednn_linear.onednn_linear_chosen()  # its check's calls are not the test's

    def counting(x, weight, bias):
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(onednn_linear, "onednn_linear_forward", counting)
    return calls


@needs_onednn
@pytest.mark.parametrize("with_bias", [False, True])
def test_no_grad_float32_linears_go_to_onednn_with_the_same_result(rerouted, with_bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    layer = torch.nn.Linear(64, 96, bias=with_bias)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    inputs = [
        torch.randn(16, 64, generator=generator),
        torch.randn(2, 7, 64, generator=generator),  # a prefill's [batch, time, hidden]
        torch.randn(64, 5, generator=generator).t(),  # not contiguous
    ]
    for x in inputs:
        with torch.inference_mode():
            expected = F.linear(x, weight, bias)
            with onednn_linears("cpu"):
                got_module = layer(x)
                got_function = F.linear(x, weight, bias=bias)
        torch.testing.assert_close(got_module, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_function, expected, rtol=1e-5, atol=1e-5)
    assert rerouted == [(16, 64), (16, 64), (2, 7, 64), (2, 7, 64), (5, 64), (5, 64)]


@needs_onednn
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("frozen_weight", [False, True])  # a LoRA base layer
def test_gradients_match_f_linear(rerouted, with_bias, frozen_weight):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 32, generator=generator, requires_grad=True)
    weight = torch.randn(24, 32, generator=generator, requires_grad=not frozen_weight)
    bias = torch.randn(24, generator=generator, requires_grad=True) if with_bias else None
    upstream = torch.randn(3, 5, 24, generator=generator)
    leaves = [t for t in (x, weight, bias) if t is not None and t.requires_grad]

    expected = torch.autograd.grad(F.linear(x, weight, bias), leaves, upstream)
    with onednn_linears("cpu"):
        out = F.linear(x, weight, bias)
    got = torch.autograd.grad(out, leaves, upstream)
    # The forward, then the backward's input gradient and (when trained) the weight gradient.
    assert rerouted == [(3, 5, 32), (3, 5, 24)] + ([] if frozen_weight else [(24, 15)])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_autocast_keeps_f_linear(rerouted):
    with torch.autocast("cpu", dtype=torch.bfloat16), onednn_linears("cpu"):
        out = F.linear(torch.randn(4, 8), torch.randn(6, 8))
    assert rerouted == [] and out.dtype == torch.bfloat16


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_stay_on_f_linear(rerouted, dtype):
    x, weight = torch.randn(4, 8, dtype=dtype), torch.randn(6, 8, dtype=dtype)
    with torch.inference_mode(), onednn_linears("cpu"):
        out = F.linear(x, weight)
    assert rerouted == [] and out.dtype == dtype


@needs_onednn
def test_the_mode_is_the_entering_threads_only(rerouted):
    """A trainer's thread beside a sampling thread keeps plain F.linear."""
    entered, other_done = threading.Event(), threading.Event()

    def other_thread() -> None:
        entered.wait(timeout=10)
        with torch.inference_mode():
            F.linear(torch.randn(2, 8), torch.randn(3, 8))
        other_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with torch.inference_mode(), onednn_linears("cpu"):
        entered.set()
        assert other_done.wait(timeout=10)
        F.linear(torch.randn(5, 8), torch.randn(3, 8))
    thread.join()
    assert rerouted == [(5, 8)]


def test_off_cpu_or_switched_off_it_does_nothing(monkeypatch):
    assert not isinstance(onednn_linears("meta"), OneDnnLinears)
    monkeypatch.setenv(onednn_linear.SWITCH_VARIABLE, "0")
    assert not isinstance(onednn_linears("cpu"), OneDnnLinears)


@needs_onednn
@pytest.mark.parametrize(("speedup", "chosen"), [(2.2, True), (1.05, False), (0.8, False)])
def test_left_to_itself_it_is_chosen_where_it_measured_faster(monkeypatch, speedup, chosen):
    monkeypatch.delenv(onednn_linear.SWITCH_VARIABLE)
    monkeypatch.setattr(onednn_linear, "onednn_linear_speedup", lambda: speedup)
    assert isinstance(onednn_linears("cpu"), OneDnnLinears) is chosen


def test_a_build_whose_op_disagrees_is_not_used(monkeypatch):
    wrong = lambda x, weight, bias: F.linear(x, weight) + 1  # noqa: E731
    monkeypatch.setattr(onednn_linear, "onednn_linear_forward", wrong)
    assert not onednn_linear.onednn_linear_works()
    assert not isinstance(onednn_linears("cpu"), OneDnnLinears)
