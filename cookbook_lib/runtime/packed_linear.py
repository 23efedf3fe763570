"""Linear layers whose weights are prepacked for oneDNN: a generator's CPU decode step, faster.

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
Projections that read the same input (a layer's query, key and value; its gate and up
projections) are packed as one weight (:class:`PackedGroup`): one oneDNN call instead of three
or two, each projection a slice of its output, bit-identical at these sizes: a 16-row decode
step of the embedded model took 53.6 against 54.9 ms on that Xeon (``bench/bench_decode.py``).
The swap is one-way: the model then samples but cannot be trained or saved through
``state_dict`` (the packed weights are not in it), which is why only a generator that owns its
model (a sampling copy) packs. Weight updates go through :func:`load_weights`, which repacks the
linears from the trainer's tensors and copies the rest, and :func:`weight_shapes`, which names
the packed weights as the model did.

Float32 linears are packed too where the trainer's float32 linears run in oneDNN
(``onednn_linear.onednn_linear_chosen``: CPUs where MKL's sgemm is slow, such as AMD's). There the
packed kernel gives the plain oneDNN linear's sums bit for bit from 2 rows up (a lone row is
computed as the first of two, ``onednn_linear.lone_row_as_first_of_two``: the one-row kernels sum
in their own order), and a 16-row decode step's linears, which read all 0.54 GB of the embedded
model's float32 weights, take ~0.75x the time: on a 2-core AMD EPYC without
AVX-512 (2026-12-06), 98 against 133 ms over the 30 layers' grouped projections and the head.
That CPU cannot pack bf16 weights (oneDNN needs AVX-512 or AVX-NE-CONVERT for that reorder), so
packing is decided per dtype. Elsewhere (not a CPU, a dtype this build cannot pack or whose packed
linear disagrees with ``F.linear`` on a check, float32 where MKL serves the trainer,
``COOKBOOK_PACK_LINEARS=0``) nothing is packed.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from cookbook_lib.runtime.devices import Float32Head
from cookbook_lib.runtime.onednn_linear import lone_row_as_first_of_two, onednn_linear_chosen

SWITCH_VARIABLE = "COOKBOOK_PACK_LINEARS"  # "0": never pack
# oneDNN picks the packed layout for a row count; every count runs on it, this one best. A
# decode batch of the demo's 16 rows (4 tasks x 4 episodes).
ROWS_HINT = 16
# Sibling projections that a decoder layer calls on the same tensor, in the families we serve
# (Llama, Qwen, Mistral, Gemma, GLM, gpt-oss name them so). A family that calls one of them on
# another input still gets the right numbers (PackedGroup recomputes), only not the saving.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def packed_linear_forward(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a weight :func:`pack_weight` packed (no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) reordered into oneDNN's blocked layout: an opaque tensor of its size."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward (no grad) on a weight packed for oneDNN; the plain weight is not kept."""

    def __init__(self, linear: torch.nn.Linear | Float32Head) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.packed = pack_weight(linear.weight)
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
        self.packed = pack_weight(weight.to(device="cpu", dtype=self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lone_row_as_first_of_two(packed_linear_forward, x.to(self.dtype), self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class PackedGroup:
    """Linears that read the same input, packed as one weight: the first of them to be called with
    an input computes every one's output, and the others take their slice of it.

    Not a module: the parts (:class:`PackedPart`) are the model's children and hold the state
    dict's names; this holds the packed weight they share and the output not yet taken.
    """

    def __init__(self, linears: Sequence[torch.nn.Linear]) -> None:
        self.sizes = [linear.out_features for linear in linears]
        self.in_features = linears[0].in_features
        self.dtype = linears[0].weight.dtype
        with torch.no_grad():
            self.packed = pack_weight(torch.cat([linear.weight for linear in linears]))
        self.biases = [linear.bias for linear in linears]  # each part's parameter, in the state dict
        self.bias = self._joined_bias()
        self._input: weakref.ref | None = None
        self._outputs: list[torch.Tensor | None] = []

    def _joined_bias(self) -> torch.Tensor | None:
        if self.biases[0] is None:
            return None
        with torch.no_grad():
            return torch.cat([bias.detach() for bias in self.biases])

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index``'s output for ``x``: computed with the others' unless they were just computed
        for this very tensor and this part has not taken its slice yet."""
        fresh = self._input is not None and self._input() is x and self._outputs[index] is not None
        if not fresh:
            joined = lone_row_as_first_of_two(packed_linear_forward, x.to(self.dtype), self.packed, self.bias)
            self._outputs = list(joined.split(self.sizes, dim=-1))
            self._input = weakref.ref(x)
        output, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):  # every part took its slice: hold nothing
            self._input = None
        return output

    def unpacked(self) -> torch.Tensor:
        """The joined weight ``[sum(sizes), in_features]``, read back exactly: the identity through the
        packed weight (each output is one weight times 1 plus zeros)."""
        with torch.inference_mode():
            identity = torch.eye(self.in_features, dtype=self.dtype)
            return packed_linear_forward(identity, self.packed, None).t().contiguous()

    def load(self, weights: Mapping[int, torch.Tensor]) -> None:
        """Repack with the parts in ``weights`` (part index: weight) replaced; the others kept."""
        for index, weight in weights.items():
            expected = (self.sizes[index], self.in_features)
            if tuple(weight.shape) != expected:
                raise ValueError(f"a weight of shape {tuple(weight.shape)} for a {expected} layer")
        # A partial update keeps the parts not in it as they are now.
        kept = self.unpacked().split(self.sizes) if len(weights) < len(self.sizes) else None
        parts = [weights[i] if i in weights else kept[i] for i in range(len(self.sizes))]
        joined = torch.cat([part.to(device="cpu", dtype=self.dtype) for part in parts])
        del parts
        self.packed = None  # the old packing goes first, as in PackedLinear.load
        self.packed = pack_weight(joined)
        self.refresh_bias()

    def refresh_bias(self) -> None:
        """Join the parts' biases again (after they were copied into)."""
        self.bias = self._joined_bias()


class PackedPart(torch.nn.Module):
    """One projection of a :class:`PackedGroup`: ``nn.Linear``'s forward (no grad), its slice."""

    def __init__(self, group: PackedGroup, index: int) -> None:
        super().__init__()
        self.group, self.index = group, index
        self.out_features, self.in_features = group.sizes[index], group.in_features
        self.dtype = group.dtype
        self.bias = group.biases[index]  # a plain parameter, in the state dict as before

    @property
    def weight_shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def load(self, weight: torch.Tensor) -> None:
        """Repack the group with this part's weight replaced (``load_weights`` repacks once per group)."""
        self.group.load({self.index: weight})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        part = f"part {self.index + 1} of {len(self.group.sizes)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {part} packed together"


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether this torch build packs ``dtype`` weights on this CPU and its packed linear agrees with
    ``F.linear`` on a check: bf16 to the bit (the same oneDNN kernel at these sizes), float32 to
    float32 rounding (``F.linear`` may be MKL's)."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 576, generator=generator)
    bias = torch.randn(256, generator=generator)
    agree = torch.equal if dtype == torch.bfloat16 else _float32_close
    try:
        with torch.inference_mode():
            packed = pack_weight(weight.to(dtype))
            for rows in (1, ROWS_HINT, 37):
                x = torch.randn(rows, 576, generator=generator).to(dtype)
                for b in (None, bias.to(dtype)):
                    if not agree(packed_linear_forward(x, packed, b), F.linear(x, weight.to(dtype), b)):
                        return False
    except (RuntimeError, AttributeError, NotImplementedError):  # e.g. bf16 on a CPU without AVX-512
        return False
    return True


def packed_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose linears :func:`pack_linears` packs here: bf16 where it packs, float32 where
    it packs and the trainer's float32 linears run in oneDNN too (so sampling and training share a
    kernel family), none with ``COOKBOOK_PACK_LINEARS=0``."""
    if os.environ.get(SWITCH_VARIABLE, "") == "0":
        return frozenset()
    chosen = {torch.bfloat16: packs(torch.bfloat16)}
    chosen[torch.float32] = packs(torch.float32) and onednn_linear_chosen()
    return frozenset(dtype for dtype, on in chosen.items() if on)


def _float32_close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def _packable(module: torch.nn.Module, dtypes: frozenset[torch.dtype]) -> bool:
    if isinstance(module, Float32Head):  # a bf16 copy's float32 output layer: the largest matmul
        # A head shared with the trained model stays: a packed copy would cost its 0.11 GB again.
        # Packed wherever float32 packs: its logits are within float32 rounding of MKL's (~5e-6
        # at |20|), and on a bf16 copy it is the one float32 matmul of a step.
        return module.weight.device.type == "cpu" and not module.shared and packs(torch.float32)
    return (
        type(module) is torch.nn.Linear  # subclasses (LoRA layers, quantised ones) do more than a matmul
        and module.weight.device.type == "cpu"
        and module.weight.dtype in dtypes
    )


def pack_linears(model: torch.nn.Module, group: bool = True) -> int:
    """Swap ``model``'s CPU ``nn.Linear`` layers of a :func:`packed_dtypes` dtype for :class:`PackedLinear`
    ones; how many were swapped.

    With ``group``, sibling projections of one input (:data:`GROUPS`) become the :class:`PackedPart`
    slices of one :class:`PackedGroup` instead. Packs nothing (0) where packing is off or does not
    work here. The model keeps sampling the same tokens, but can no longer be trained: call it on a
    copy only a generator uses.
    """
    dtypes = packed_dtypes()
    if not dtypes:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        children = {name: child for name, child in parent.named_children() if _packable(child, dtypes)}
        swapped += len(children)
        with torch.no_grad():
            for names in GROUPS if group else ():
                linears = [children.get(name) for name in names]
                if _groupable(linears):
                    shared = PackedGroup(linears)
                    for index, name in enumerate(names):
                        setattr(parent, name, PackedPart(shared, index))
                        del children[name]
            for name, child in children.items():
                setattr(parent, name, PackedLinear(child))
    return swapped


def _groupable(linears: list) -> bool:
    if any(type(linear) is not torch.nn.Linear for linear in linears):  # absent, or a head
        return False
    first = linears[0]
    return all(
        linear.in_features == first.in_features
        and linear.weight.dtype == first.weight.dtype
        and (linear.bias is None) == (first.bias is None)
        for linear in linears
    )


def packed_layers(model: torch.nn.Module) -> dict[str, PackedLinear | PackedPart]:
    """Every packed layer of ``model``, under the name of the weight it replaced (``...q_proj.weight``)."""
    packed = (PackedLinear, PackedPart)
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, packed)}


def weight_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The shape of every weight ``model`` can load, packed ones under their ``nn.Linear`` names."""
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    shapes.update({name: layer.weight_shape for name, layer in packed_layers(model).items()})
    return shapes


def load_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``: packed layers repack, every other tensor is copied in place."""
    packed = packed_layers(model)
    own = model.state_dict()  # tensors sharing storage with the parameters
    groups: dict[PackedGroup, dict[int, torch.Tensor]] = {}
    with torch.no_grad():
        for name, tensor in state_dict.items():
            layer = packed.get(name)
            if isinstance(layer, PackedPart):  # repacked below, with its group's other parts
                groups.setdefault(layer.group, {})[layer.index] = tensor
            elif layer is not None:
                layer.load(tensor)
            elif own[name].data_ptr() != tensor.data_ptr():  # not the trained weight itself (a shared head)
                own[name].copy_(tensor)
        for group, weights in groups.items():
            group.load(weights)  # joins its biases again too
        every_group = {layer.group for layer in packed.values() if isinstance(layer, PackedPart)}
        for group in every_group - groups.keys():
            group.refresh_bias()  # a bias may have been copied without its weight
