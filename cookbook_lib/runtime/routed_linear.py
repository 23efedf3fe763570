"""A generator's linears to oneDNN without a torch function mode: the layers route themselves.

``onednn_linear.OneDnnLinears`` is a ``TorchFunctionMode``: while it is on, every torch function
the thread calls goes through its Python ``__torch_function__``, about 2,100 of them in one decode
step of the embedded model, of which only its 211 linears change course. On a 2-core AMD EPYC
(2026-12-06, ``bench/bench_decode.py``, 16 rows after a 440-token prompt) a float32 decode step
under the mode took 264 ms against 221 through MKL with no mode at all: the mode's Python cost
ate oneDNN's gain. A generator on a model it does not own (a lockstep run samples from the trained
model itself) cannot prepack the weights (``packed_linear.py``), so it routes them instead:
:func:`route_linears` gives each plain ``nn.Linear`` of its model a forward that calls oneDNN
directly while the calling thread is inside :func:`routed_linears`, one Python check per linear
and none for the other ops.

Elsewhere the layer's forward is ``nn.Linear``'s own: on other threads (a trainer's, which has its
own ``OneDnnLinears`` for the gradients), with grad enabled, under autocast, and for inputs that are
not float32 on a CPU. The numbers are those of ``OneDnnLinears`` (the same oneDNN call), except
for a lone row, which is computed as the first of two: oneDNN's one-row kernel sums in another
order, and with it a row decoded alone would not compute what it computes in a batch. The route
is an instance attribute of each layer (``forward``), so it survives ``copy.deepcopy`` (bound to
the copy's own weights) and pickling, and leaves ``state_dict`` as it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from cookbook_lib.runtime.onednn_linear import onednn_linear_chosen, onednn_linear_forward, runs_in_onednn

_routing = threading.local()  # .on: this thread's routed layers go to oneDNN now


class RoutedForward:
    """The ``forward`` :func:`route_linears` gives an ``nn.Linear``: oneDNN inside :func:`routed_linears`."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        self.layer = layer

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's name, for keyword calls
        layer = self.layer
        if (
            getattr(_routing, "on", False)
            and not torch.is_grad_enabled()
            and runs_in_onednn(input, layer.weight, layer.bias)
        ):
            return _batch_invariant_linear(input, layer.weight, layer.bias)
        return torch.nn.Linear.forward(layer, input)


def _batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear, a lone row computed as the first of two: its matrix-vector kernel sums in another
    order (~1e-4 apart at the embedded model's sizes), so a row decoded alone would not compute what
    it computes in a batch, and seeded samples could differ with the batch around them. From 2 rows
    up each row's sums do not depend on the others (checked at 2-16 rows on an AMD EPYC)."""
    if x.numel() != x.shape[-1]:
        return onednn_linear_forward(x, weight, bias)
    row = x.reshape(1, x.shape[-1])
    first_of_two = onednn_linear_forward(torch.cat([row, row]), weight, bias)[:1]
    return first_of_two.reshape(*x.shape[:-1], weight.shape[0])


def route_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s plain ``nn.Linear`` layers (see the module's docstring); how many are routed now.

    Subclasses (LoRA layers, quantised ones) do more than a matmul and keep their forward; a layer
    routed before is left as it is. Routes nothing where oneDNN's linear is not chosen here.
    """
    if not onednn_linear_chosen():
        return 0
    routed = 0
    for layer in model.modules():
        if type(layer) is not torch.nn.Linear:
            continue
        if not isinstance(vars(layer).get("forward"), RoutedForward):
            layer.forward = RoutedForward(layer)
        routed += 1
    return routed


@contextlib.contextmanager
def routed_linears() -> Iterator[None]:
    """Within it, this thread's routed layers (:func:`route_linears`) compute through oneDNN."""
    before = getattr(_routing, "on", False)
    _routing.on = True
    try:
        yield
    finally:
        _routing.on = before
