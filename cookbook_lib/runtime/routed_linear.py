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
for a lone row, which is computed as the first of two: oneDNN's one-row kernels sum in another
order, and with them a row decoded alone would not compute what it computes in a batch. The route
is an instance attribute of each layer (``forward``), so it survives ``copy.deepcopy`` (bound to
the copy's own weights) and pickling, and leaves ``state_dict`` as it was.

Where float32 weights pack (``packed_linear.packed_dtypes``: the CPUs where oneDNN serves the
trainer too), a routed layer also keeps its weight packed for oneDNN while it samples: packed once
at its first routed call, reused while the weight is the same tensor at the same version (an
optimizer step or a weight update writes it in place, which bumps the version, so the next call
repacks), and let go by :func:`release_packed_weights`, which a lockstep run's generator calls
before each training step (``HFGenerator.sleep``) and when it closes. The packed kernel gives the
plain oneDNN linear's sums bit for bit from 2 rows up, and a lone row is computed as the first of
two here too (on an AVX-512 Xeon the packed one-row kernel also sums in its own order at some
shapes), so the numbers do not change; a 16-row decode step of the embedded model took ~0.8x the time
on a 2-core AMD EPYC (docs/benchmarks.md). The packed copies hold a model's worth of linear
weights (0.54 GB for the embedded model), during sampling only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from cookbook_lib.runtime.onednn_linear import (
    lone_row_as_first_of_two,
    onednn_linear_chosen,
    onednn_linear_forward,
    runs_in_onednn,
)
from cookbook_lib.runtime.packed_linear import pack_weight, packed_dtypes, packed_linear_forward

_routing = threading.local()  # .on: this thread's routed layers go to oneDNN now


class RoutedForward:
    """The ``forward`` :func:`route_linears` gives an ``nn.Linear``: oneDNN inside :func:`routed_linears`,
    from a packed copy of the weight where ``pack`` (see the module's docstring)."""

    def __init__(self, layer: torch.nn.Linear, pack: bool = False) -> None:
        self.layer = layer
        self.pack = pack
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None  # (which weight, packed)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's name, for keyword calls
        layer = self.layer
        if (
            getattr(_routing, "on", False)
            and not torch.is_grad_enabled()
            and runs_in_onednn(input, layer.weight, layer.bias)
        ):
            if self.pack:
                packed = self._packed_weight(layer.weight)
                return lone_row_as_first_of_two(packed_linear_forward, input, packed, layer.bias)
            return lone_row_as_first_of_two(onednn_linear_forward, input, layer.weight, layer.bias)
        return torch.nn.Linear.forward(layer, input)

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # The same storage at the same version: nothing has written the weight since it was packed.
        which = (weight.data_ptr(), weight._version)
        cached = self._packed
        if cached is None or cached[0] != which:
            self._packed = None  # the stale packing goes before the new one is made
            cached = self._packed = (which, pack_weight(weight))
        return cached[1]

    def release(self) -> None:
        """Let the packed weight go (the next routed call packs again)."""
        self._packed = None

    def __getstate__(self) -> dict:
        # A packed weight is an opaque oneDNN tensor: neither pickled nor deep-copied, repacked on use.
        return {"layer": self.layer, "pack": self.pack, "_packed": None}


def route_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s plain ``nn.Linear`` layers (see the module's docstring); how many are routed now.

    Subclasses (LoRA layers, quantised ones) do more than a matmul and keep their forward; a layer
    routed before keeps its route, packing or not as ``packed_dtypes`` says now. Routes nothing
    where oneDNN's linear is not chosen here.
    """
    if not onednn_linear_chosen():
        return 0
    pack = torch.float32 in packed_dtypes()
    routed = 0
    for layer in model.modules():
        if type(layer) is not torch.nn.Linear:
            continue
        route = vars(layer).get("forward")
        if isinstance(route, RoutedForward):
            route.pack = pack
            if not pack:
                route.release()
        else:
            layer.forward = RoutedForward(layer, pack=pack)
        routed += 1
    return routed


def release_packed_weights(model: torch.nn.Module) -> int:
    """Let go of the packed weights ``model``'s routed layers keep; how many there were."""
    released = 0
    for layer in model.modules():
        route = vars(layer).get("forward")
        if isinstance(route, RoutedForward) and route._packed is not None:
            route.release()
            released += 1
    return released


@contextlib.contextmanager
def routed_linears() -> Iterator[None]:
    """Within it, this thread's routed layers (:func:`route_linears`) compute through oneDNN."""
    before = getattr(_routing, "on", False)
    _routing.on = True
    try:
        yield
    finally:
        _routing.on = before
