"""Linear layers whose bf16 weights are prepacked for oneDNN: a generator's CPU decode step, faster.

A bf16 ``F.linear`` on a CPU already runs in oneDNN, but from the plain ``[out, in]`` weight,
which oneDNN reorders into its blocked layout on every call. At a decode step's few rows that
reorder is most of the work: on a 2-core Xeon with AMX (2026-12-05) the embedded model's 210
projections at 16 rows took 20.5 ms from plain weights and 11.5 ms from weights reordered once
(``torch.ops.mkldnn._reorder_linear_weight``), with bit-identical results at every row count
from 1 to 7,040 (the same kernel, the same sums); prefill's thousands of rows are as fast either way.
For layers much smaller than these, ``F.linear`` takes another kernel, and an output may round to
the neighbouring bf16 value.

:func:`pack_linears` swaps every bf16 ``nn.Linear`` of a model, and a bf16 copy's float32 head
(``devices.Float32Head``: 7.7 against 5.5 ms at 16 rows), for a :class:`PackedLinear` that
keeps only the packed weight (an opaque oneDNN tensor of the same size), so memory does not grow.
The swap is one-way: the model then samples but cannot be trained or saved through
``state_dict`` (the packed weights are not in it), which is why only a generator that owns its
model (a sampling copy) packs. Weight updates go through :func:`load_weights`, which repacks the
linears from the trainer's tensors and copies the rest, and :func:`weight_shapes`, which names
the packed weights as the model did. Elsewhere (not a CPU, float32 weights, a torch build without
oneDNN or whose packed linear disagrees with ``F.linear`` on a check, ``COOKBOOK_PACK_LINEARS=0``)
nothing is packed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from cookbook_lib.runtime.devices import Float32Head

SWITCH_VARIABLE = "COOKBOOK_PACK_LINEARS"  # "0": never pack
# Linears in float32 stay with MKL, whose sums the trainer's match; a bf16 copy's float32 head
# (devices.Float32Head) is packed, its logits within float32 rounding of MKL's (~5e-6 at |20|).
PACKED_DTYPES = (torch.bfloat16,)
# oneDNN picks the packed layout for a row count; every count runs on it, this one best. A
# decode batch of the demo's 16 rows (4 tasks x 4 episodes).
ROWS_HINT = 16


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward (no grad) on a weight packed for oneDNN; the plain weight is not kept."""

    def __init__(self, linear: torch.nn.Linear | Float32Head) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.packed = _pack(linear.weight)
        # The bias stays a plain parameter: state_dict and the weight update treat it as before.
        self.bias = getattr(linear, "bias", None)

    @property
    def weight_shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def load(self, weight: torch.Tensor) -> None:
        """Repack from a new weight (any dtype and device: cast to this layer's)."""
        if weight.shape != self.weight_shape:
            shapes = f"{tuple(weight.shape)} for a {tuple(self.weight_shape)} layer"
            raise ValueError(f"a weight of shape {shapes}")
        # The old packing goes first: the new one (and the cast before it) can take its memory
        # instead of leaving a hole of its size in the heap at every update.
        del self.packed
        self.packed = _pack(weight.to(device="cpu", dtype=self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x.to(self.dtype), self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


@functools.cache
def packing_works() -> bool:
    """Whether this torch build packs weights and its packed linear agrees with ``F.linear`` on a check:
    bf16 to the bit (the same oneDNN kernel at these sizes), a float32 head to float32 rounding."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 576, generator=generator)
    bias = torch.randn(256, generator=generator)
    try:
        with torch.inference_mode():
            for dtype in (torch.bfloat16, torch.float32):
                packed = _pack(weight.to(dtype))
                for rows in (1, ROWS_HINT, 37):
                    x = torch.randn(rows, 576, generator=generator).to(dtype)
                    for b in (None, bias.to(dtype)):
                        ours, theirs = _packed_linear(x, packed, b), F.linear(x, weight.to(dtype), b)
                        agree = torch.equal if dtype == torch.bfloat16 else _float32_close
                        if not agree(ours, theirs):
                            return False
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def _float32_close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def _packable(module: torch.nn.Module) -> bool:
    if isinstance(module, Float32Head):  # a bf16 copy's float32 output layer: the largest matmul
        # A head shared with the trained model stays: a packed copy would cost its 0.11 GB again.
        return module.weight.device.type == "cpu" and not module.shared
    return (
        type(module) is torch.nn.Linear  # subclasses (LoRA layers, quantised ones) do more than a matmul
        and module.weight.device.type == "cpu"
        and module.weight.dtype in PACKED_DTYPES
    )


def pack_linears(model: torch.nn.Module) -> int:
    """Swap ``model``'s bf16 CPU ``nn.Linear`` layers for :class:`PackedLinear` ones; how many were swapped.

    Packs nothing (0) where packing is off or does not work here. The model keeps sampling the
    same tokens, but can no longer be trained: call it on a copy only a generator uses.
    """
    if os.environ.get(SWITCH_VARIABLE, "") == "0" or not packing_works():
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child)
    ]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child))
    return len(swaps)


def packed_layers(model: torch.nn.Module) -> dict[str, PackedLinear]:
    """Every packed layer of ``model``, under the name of the weight it replaced (``...q_proj.weight``)."""
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, PackedLinear)}


def weight_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The shape of every weight ``model`` can load, packed ones under their ``nn.Linear`` names."""
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    shapes.update({name: layer.weight_shape for name, layer in packed_layers(model).items()})
    return shapes


def load_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``: packed layers repack, every other tensor is copied in place."""
    packed = packed_layers(model)
    own = model.state_dict()  # tensors sharing storage with the parameters
    with torch.no_grad():
        for name, tensor in state_dict.items():
            if name in packed:
                packed[name].load(tensor)
            elif own[name].data_ptr() != tensor.data_ptr():  # not the trained weight itself (a shared head)
                own[name].copy_(tensor)
