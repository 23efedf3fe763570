"""Where a run computes and in which precision: ``GRPOConfig.device`` and ``GRPOConfig.dtype``.

``device``: ``"auto"`` (CUDA when present, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

``dtype`` names a *policy*, not one tensor type, because sampling and training want different
things:

| dtype | generator (weights, KV cache) | trainer weights and AdamW state | trainer forward/backward |
| --- | --- | --- | --- |
| ``float32`` | float32 | float32 | float32 |
| ``bfloat16`` | bfloat16 | float32 | bfloat16 autocast |
| ``float16`` | float16 | float32 | float32 (fp16 training would need loss scaling) |

``auto`` is ``bfloat16`` on a GPU with bf16, ``float16`` on a GPU without it (Colab's T4), and on a
CPU whatever its matmuls measure faster: ``bfloat16`` where a short probe (``cpu_probe``, cached per
CPU) finds bf16 matmuls at least :data:`AUTO_BF16_MIN_SPEEDUP` times the float32 rate (native bf16:
AVX512-BF16, AMX), else ``float32`` (a CPU without native bf16, such as an AMD EPYC with AVX2 only,
emulates bf16 matmuls at ~0.02x the float32 rate). The run's first line says which and why.

What bf16 costs: the sampler's and the trainer's log-probs of the same fresh tokens differ by the
rounding of two bf16 forwards of different shapes (a cached one-token decode against one full
forward). On the embedded model, mean |log ratio| 0.034, 99th percentile 0.18, max 0.43, even with
both heads in float32; float32 keeps the ratio at 1 (max |ratio - 1| ~2e-5). The clipped importance
ratio absorbs it, as on every GPU (vLLM-based trainers pay it too), and the demo learns as well in
bf16 as in float32 over several seeds on a CPU with AMX (``docs/benchmarks.md``), in less time.
``dtype="float32"`` keeps exact ratios; ``COOKBOOK_CPU_BF16=0`` makes ``auto`` keep float32 on
every CPU (the test suite sets it, so that its bit-for-bit comparisons hold on any CPU).

The trainer keeps float32 master weights in every policy: an AdamW update of ``lr * ~1`` is far
below bfloat16's resolution for weights of order 0.01-0.1, so pure-bf16 weights would drop most
updates. The output layer runs in float32 in the generator (:class:`Float32Head`) and in the
trainer, so log-probs and the loss are float32; the importance ratio of a freshly sampled token
is 1 up to the rounding of the low-precision forward passes (``tests/test_precision.py`` states
the tolerance per dtype).

Checks come in two kinds: the spelling of the two fields is checked by ``GRPOConfig.validate``
(no torch import); whether the machine has what they ask for (a CUDA device, that index, bf16
support) is checked here by :func:`precision_problems`, which ``train_multi_turn`` calls before
any model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import get_args

import torch

from cookbook_lib.grpo.config import DEVICE_PATTERN, DTypeName

DTYPES: tuple[str, ...] = get_args(DTypeName)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

AUTO_BF16_MIN_SPEEDUP = 2.0
"""``dtype="auto"`` picks bf16 on a CPU whose bf16 matmuls measure at least this many times the
float32 rate: native bf16 measures 3.9-4.5x on two cores (AMX), emulated ~0.02x. Below 2x the
casts and the inexact importance ratio would cost more than the matmuls save."""
CPU_BF16_SWITCH = "COOKBOOK_CPU_BF16"
"""Set to ``0``, ``dtype="auto"`` keeps float32 on every CPU (and pays no probe)."""


@dataclass(frozen=True)
class Precision:
    """A resolved ``(device, dtype)`` pair: what each part of a run uses."""

    device: torch.device
    sample_dtype: torch.dtype
    """Generator weights and KV cache."""
    compute_dtype: torch.dtype
    """The trainer's autocast dtype; float32 means no autocast."""
    master_dtype: torch.dtype = torch.float32
    """The trained weights and the optimizer state (always float32; see the module doc)."""
    auto_reason: str = field(default="", compare=False)
    """Why ``dtype="auto"`` chose this precision on a CPU, for the run's first line; empty otherwise."""

    @property
    def autocast(self) -> bool:
        return self.compute_dtype != torch.float32

    def describe(self) -> str:
        """One line for a notebook or a log: where the run computes, in what precision."""
        where = str(self.device)
        if self.device.type == "cuda":
            where += f" ({torch.cuda.get_device_name(self.device)})"
        sample, compute = _short(self.sample_dtype), _short(self.compute_dtype)
        line = f"device {where}; sampling in {sample}, training in {compute} with float32 weights"
        if self.auto_reason:
            return f"{line} ({self.auto_reason})"
        return line + self._cpu_bf16_note()

    def _cpu_bf16_note(self) -> str:
        """On a CPU asked for bf16: whether it has native bf16 (measured), for the run's first line."""
        if self.device.type != "cpu" or torch.bfloat16 not in (self.sample_dtype, self.compute_dtype):
            return ""
        from cookbook_lib.runtime.cpu_probe import bf16_speedup  # only a bf16 CPU run pays the probe

        speedup = bf16_speedup()
        if speedup >= 1.0:
            return f" (bf16 matmuls {speedup:.1f}x the float32 rate on this CPU)"
        return (
            f" (bf16 matmuls {speedup:.2f}x the float32 rate on this CPU, which lacks native bf16: "
            "dtype='float32' runs faster here)"
        )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(spec: str = "auto") -> torch.device:
    """``"auto"`` is CUDA (device 0) when torch sees a GPU, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def cpu_auto_dtype() -> tuple[str, str]:
    """What ``dtype="auto"`` picks on this CPU, and why in a few words (the run's first line)."""
    if os.environ.get(CPU_BF16_SWITCH, "").strip() == "0":
        return "float32", f"dtype auto: float32, as {CPU_BF16_SWITCH}=0 asks"
    from cookbook_lib.runtime.cpu_probe import bf16_speedup  # a probe of a second at most, cached per CPU

    speedup = bf16_speedup()
    if speedup >= AUTO_BF16_MIN_SPEEDUP:
        return "bfloat16", (
            f"dtype auto: bf16 matmuls {speedup:.1f}x the float32 rate on this CPU; "
            "dtype='float32' keeps importance ratios exact"
        )
    return "float32", f"dtype auto: float32, as bf16 matmuls run {speedup:.2g}x its rate on this CPU"


def resolve_precision(device: str = "auto", dtype: str = "auto") -> Precision:
    """The precision policy for ``device`` and ``dtype`` (call :func:`precision_problems` first)."""
    where = resolve_device(device)
    reason = ""
    if dtype == "auto":
        if where.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype, reason = cpu_auto_dtype()  # measured: see the module doc
    sample = _TORCH_DTYPES[dtype]
    # float16 trains in float32: fp16 gradients underflow without a loss scaler.
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return Precision(device=where, sample_dtype=sample, compute_dtype=compute, auto_reason=reason)


def precision_problems(device: str, dtype: str) -> list[str]:
    """What this machine lacks for ``device`` and ``dtype``, each with its fix; empty when fine."""
    problems = []
    if not isinstance(device, str) or not DEVICE_PATTERN.match(device):
        return [f"device={device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'"]
    if dtype not in DTYPES:
        return [f"dtype={dtype!r} is not one of {', '.join(map(repr, DTYPES))}"]
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return [
                f"device={device!r} but torch sees no CUDA GPU (torch {torch.__version__}, built "
                f"{'with CUDA ' + torch.version.cuda if torch.version.cuda else 'without CUDA'}): "
                "use device='auto' or 'cpu', or install a CUDA build of torch on a GPU machine"
            ]
        index = torch.device(device).index
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            problems.append(
                f"device={device!r} but this machine has {count} GPU(s): use cuda:0..cuda:{count - 1}"
            )
        elif dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            problems.append(
                f"dtype='bfloat16' but {torch.cuda.get_device_name(index or 0)} has no bf16 support: "
                "use dtype='float16' (or 'auto', which picks it)"
            )
    elif dtype == "float16" and resolve_device(device).type == "cpu":
        problems.append(
            "dtype='float16' on the CPU: half-precision sampling is slow or unsupported on CPUs; use "
            "dtype='auto' (bfloat16 where the CPU has it, else float32) or 'float32'"
        )
    return problems


def check_precision(device: str, dtype: str) -> Precision:
    """Resolve ``device`` and ``dtype``, or raise ValueError with every problem and its fix."""
    problems = precision_problems(device, dtype)
    if problems:
        raise ValueError("; ".join(problems))
    return resolve_precision(device, dtype)


class Float32Head(torch.nn.Module):
    """An output layer that computes logits in float32 from a low-precision model's hidden states.

    Rounding the logits to bf16 (8 bits of mantissa: steps of 0.125 at magnitude 20) moves each
    token's log-prob by up to a few tenths, in the sampler and the trainer independently, so the
    importance ratio of a fresh sample would be far from 1; the MiniMax-M1 report traced the same
    train/inference mismatch to the LM head and fixed it this way. The weight is float32 (a copy of
    the trained weights, updated with them), the matmul is float32, and it costs one
    ``[rows, hidden] x [hidden, vocab]`` product per step.

    ``shared=True`` keeps the trained model's own float32 parameter instead of a copy (lockstep,
    where nothing samples while it changes): 0.11 GB less for the embedded model, and the weight
    update has nothing to copy for it.
    """

    def __init__(self, weight: torch.Tensor, *, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        if shared:
            if not isinstance(weight, torch.nn.Parameter) or weight.dtype != torch.float32:
                raise ValueError("a shared head needs the trained model's float32 Parameter")
            self.weight = weight
        else:
            self.weight = torch.nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.to(torch.float32), self.weight)


def sampling_copy(
    model: torch.nn.Module, precision: Precision, *, share_head: bool = False
) -> torch.nn.Module:
    """A copy of the trained ``model`` for a generator: in the sampling dtype, its head in float32.

    The head is taken from the float32 weights before the cast, so it is exact; it is untied from
    the (now low-precision) input embeddings, and ``update_weights`` fills both from the trainer's
    state dict, where tied weights appear under both names. ``share_head=True`` (a float32 master
    that changes only while nothing samples: lockstep) uses the master's head parameter itself.
    """
    import copy

    duplicate = copy.deepcopy(model)
    head = duplicate.get_output_embeddings()
    exact_head = None
    if precision.sample_dtype != torch.float32 and head is not None and getattr(head, "bias", None) is None:
        master = model.get_output_embeddings()
        shareable = share_head and master is not None and master.weight.dtype == torch.float32
        exact_head = Float32Head(master.weight, shared=True) if shareable else Float32Head(head.weight)
    duplicate = duplicate.to(precision.sample_dtype)
    if exact_head is not None:
        duplicate.set_output_embeddings(exact_head)
        # Keep transformers from re-tying the head to the bf16 embeddings on a later tie_weights().
        duplicate.config.tie_word_embeddings = False
    return duplicate.eval()


def autocast(precision: Precision) -> torch.autocast:
    """The trainer's forward context: bf16 autocast when the policy computes in bf16, else off.

    Without autocast's cache of cast weights: each weight is used once per forward (and once in
    checkpointing's recomputation, a context of its own), so the cache saves no cast and would
    hold a bf16 copy of every weight, 0.27 GB of the embedded model, at a step's peak.
    """
    return torch.autocast(
        device_type=precision.device.type,
        dtype=precision.compute_dtype,
        enabled=precision.autocast,
        cache_enabled=False,
    )


__all__ = [
    "DEVICE_PATTERN",
    "DTYPES",
    "Precision",
    "autocast",
    "check_precision",
    "cpu_auto_dtype",
    "precision_problems",
    "resolve_device",
    "resolve_precision",
]
