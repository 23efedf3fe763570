"""Linear layers through oneDNN on a CPU: the same weights, about half the matmul time on AMD.

On a CPU, ``F.linear`` in float32 goes to MKL's sgemm, which runs far under its best on AMD
CPUs. On a 2-core AMD EPYC (Zen 3; 2026-12-02), oneDNN's ``mkldnn._linear_pointwise`` on the same
dense weights (no copy, no repacking) took 0.29x MKL's time for 16 rows of the embedded model's LM
head (``[16, 576] @ [576, 49152]``: 14 against 48 ms), 0.45-0.55x for the projections at every row
count from 16 to 4096, and 0.5-0.6x for a weight gradient; a 16-row decode step went 0.61x
(``bench/bench_decode.py``). The results differ from MKL's in rounding only (largest logit
difference ~1e-4 on logits of magnitude ~20): both are float32 sums, in different orders.

:func:`onednn_linears` is a torch function mode, active on the thread that enters it only (torch
keeps the mode stack per thread): the trainer enters it around a step's forwards and backwards.
A generator's worker does not: the mode runs Python for every torch function of a decode step,
which cost more than oneDNN saved there, so its model's layers route themselves
(``routed_linear.py``) or are prepacked (``packed_linear.py``). With grad mode off, a float32 CPU ``F.linear``
becomes one oneDNN call; with it on, :class:`OneDnnLinearFunction`, whose backward computes both
gradients through oneDNN too. Other dtypes, devices and autocast regions keep ``F.linear``.
Activation checkpointing recomputes under the mode where the forward ran under it
(:func:`recompute_as_forward`, the trainer's ``context_fn``).

It is on where oneDNN measured at least ``MIN_SPEEDUP`` times MKL's rate
(:func:`onednn_linear_speedup`, once per CPU, cached): MKL is Intel's, and on an Intel CPU
the two may be even. Elsewhere (slower there, no oneDNN in this torch build, a build whose op
disagrees with ``F.linear`` on a check, or ``COOKBOOK_ONEDNN_LINEAR=0``) the mode does nothing;
``COOKBOOK_ONEDNN_LINEAR=1`` turns it on without the measurement.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cookbook_lib.runtime import cpu_probe

SWITCH_VARIABLE = "COOKBOOK_ONEDNN_LINEAR"  # "0": never, "1": wherever it works, unset: where faster
MIN_SPEEDUP = 1.1


def onednn_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed by oneDNN (no autograd): check :func:`runs_in_onednn` first."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def lone_row_as_first_of_two(
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``linear(x, weight, bias)`` (oneDNN's, from a plain or a packed weight), a lone row computed as
    the first of two.

    oneDNN's one-row kernels sum in another order (~1e-4 apart at the embedded model's sizes), so a
    row decoded alone would not compute what it computes in a batch, and seeded samples could differ
    with the batch around them. From 2 rows up each row's sums do not depend on the others, and a
    packed weight's sums are the plain weight's (checked at 2-16 rows on a 2-core AMD EPYC and on an
    AVX-512 Xeon). The plain float32 one-row kernel differs from the batch on both CPUs; the packed
    one does on the Xeon at some shapes (576x1536, the embedded model's down projection).
    """
    if x.numel() != x.shape[-1]:
        return linear(x, weight, bias)
    row = x.reshape(1, x.shape[-1])
    first_of_two = linear(torch.cat([row, row]), weight, bias)[:1]
    return first_of_two.reshape(*x.shape[:-1], first_of_two.shape[-1])


class OneDnnLinearFunction(torch.autograd.Function):
    """``F.linear`` with its forward and both gradients' matmuls through oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear_forward(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])  # [rows, out]
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear_forward(grad_out, weight.t(), None)  # grad @ W: a linear by W^T
        if ctx.needs_input_grad[1]:
            # grad^T @ x, [out, in]: a linear of grad^T by x^T. Both transposed views, no copies.
            grad_weight = onednn_linear_forward(grad_rows.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


def measure_onednn_linear_speedup() -> float:
    """oneDNN's float32 linear rate over ``F.linear``'s on this CPU now (>1: oneDNN is faster), uncached."""
    x, weight = cpu_probe.linear_operands(torch.float32)
    with torch.inference_mode():
        onednn = cpu_probe.fastest_seconds(lambda: onednn_linear_forward(x, weight, None))
        return cpu_probe.seconds_per_linear(torch.float32) / onednn


def onednn_linear_speedup(cache: Path | None = None) -> float:
    """:func:`measure_onednn_linear_speedup`, measured once per CPU model, torch version and thread count."""
    return cpu_probe.cached_ratio("onednn linear", measure_onednn_linear_speedup, cache)


@functools.cache
def onednn_linear_chosen() -> bool:
    """Whether linears go to oneDNN here: it works, and it is faster (or switched on)."""
    switch = os.environ.get(SWITCH_VARIABLE, "")
    if switch == "0" or not onednn_linear_works():
        return False
    return switch == "1" or onednn_linear_speedup() >= MIN_SPEEDUP


@functools.cache
def onednn_linear_works() -> bool:
    """Whether this torch build has oneDNN's linear and it agrees with ``F.linear`` on a check."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=generator)
    weight, bias = torch.randn(48, 64, generator=generator), torch.randn(48, generator=generator)
    try:
        with torch.inference_mode():
            ours = onednn_linear_forward(x, weight, bias), onednn_linear_forward(x, weight, None)
            theirs = F.linear(x, weight, bias), F.linear(x, weight)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    pairs = zip(ours, theirs, strict=True)
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in pairs)


def _is_cpu_float32(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype == torch.float32


def runs_in_onednn(x: object, weight: object, bias: object) -> bool:
    """Whether ``F.linear(x, weight, bias)`` may go to :func:`onednn_linear_forward`: CPU float32
    tensors of its shapes, outside autocast."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        all(_is_cpu_float32(t) for t in tensors)
        and weight.dim() == 2  # type: ignore[union-attr]
        and x.dim() >= 2  # type: ignore[union-attr]
        and not torch.is_autocast_enabled("cpu")  # autocast would have cast F.linear's inputs
    )


_active = threading.local()  # how deep this thread is in OneDnnLinears contexts


class OneDnnLinears(TorchFunctionMode):
    """Routes float32 CPU ``F.linear`` calls to oneDNN; every other call runs as it was."""

    def __enter__(self):
        _active.depth = getattr(_active, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc_info):
        _active.depth -= 1
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if runs_in_onednn(x, weight, bias):
                if torch.is_grad_enabled():
                    return OneDnnLinearFunction.apply(x, weight, bias)
                return onednn_linear_forward(x, weight, bias)
        return func(*args, **kwargs)


def recompute_as_forward() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: recompute under oneDNN where the forward ran so.

    Activation checkpointing recomputes a forward inside the backward pass, where this thread's
    mode is no longer on (``Tensor.backward`` is itself dispatched through the mode, which torch
    turns off inside its handler); checkpoint also checks that what it recomputes matches what the
    forward saved, and an MKL recomputation of a oneDNN forward saves other tensors.
    """
    recompute = OneDnnLinears() if getattr(_active, "depth", 0) > 0 else contextlib.nullcontext()
    return contextlib.nullcontext(), recompute


def onednn_linears(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context in which this thread's linears on ``device`` run through oneDNN, where it is chosen."""
    if torch.device(device).type != "cpu" or not onednn_linear_chosen():
        return contextlib.nullcontext()
    return OneDnnLinears()
