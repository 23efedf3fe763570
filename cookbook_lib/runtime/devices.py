"""Where a run computes and in which precision: ``GRPOConfig.device`` and ``GRPOConfig.dtype``.

``device``: ``"auto"`` (CUDA when present, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

``dtype`` names a *policy*, not one tensor type, because sampling and training want different
things:

| dtype | generator (weights, KV cache) | trainer weights and AdamW state | trainer forward/backward |
| --- | --- | --- | --- |
| ``float32`` | float32 | float32 | float32 |
| ``bfloat16`` | bfloat16 | float32 | bfloat16 autocast |
| ``float16`` | float16 | float32 | float32 (fp16 training would need loss scaling) |

``auto`` is ``bfloat16`` on a GPU with bf16, ``float16`` on a GPU without it (Colab's T4), and
``float32`` on a CPU. Why not bf16 on a CPU with native bf16 (AVX512-BF16, AMX), where it is
faster (measured on 2 such cores with the embedded model: a bf16 matmul ~4.4x the fp32 rate, a
full AdamW step on 8 x 256 tokens 4.8 s against 12.8 s, a 32-row decode step 82 ms against
111 ms)? Because the sampler's and the trainer's log-probs of the same fresh tokens then differ:
on the embedded model, mean |log ratio| 0.034, 99th percentile 0.18, max 0.43, even with both
heads in float32 and even with a pure-bf16 trainer (the cached decode and the full forward round
differently). A first PPO step would see importance ratios up to 1.4 on tokens sampled by the
current policy. On a GPU that is the accepted price of bf16 (vLLM-based trainers pay it too); on
a CPU float32 keeps the ratio at 1 (max |ratio - 1| ~2e-5) and ``dtype="bfloat16"`` is there for
whoever wants the speed. That speed needs native bf16: a CPU without it (AVX2 only) emulates bf16
matmuls at ~0.02x the fp32 rate, so a bf16 CPU run's first line says which kind of CPU it is on,
measured once per CPU (``cpu_probe``). ``docs/benchmarks.md`` has the figures.

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

from dataclasses import dataclass
from typing import get_args

import torch

from cookbook_lib.grpo.config import DEVICE_PATTERN, DTypeName

DTYPES: tuple[str, ...] = get_args(DTypeName)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_precision(device: str = "auto", dtype: str = "auto") -> Precision:
    """The precision policy for ``device`` and ``dtype`` (call :func:`precision_problems` first)."""
    where = resolve_device(device)
    if dtype == "auto":
        if where.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype = "float32"  # a CPU: see the module doc for why not bf16
    sample = _TORCH_DTYPES[dtype]
    # float16 trains in float32: fp16 gradients underflow without a loss scaler.
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return Precision(device=where, sample_dtype=sample, compute_dtype=compute)


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
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.to(torch.float32), self.weight)


def sampling_copy(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """A copy of the trained ``model`` for a generator: in the sampling dtype, its head in float32.

    The head is taken from the float32 weights before the cast, so it is exact; it is untied from
    the (now low-precision) input embeddings, and ``update_weights`` fills both from the trainer's
    state dict, where tied weights appear under both names.
    """
    import copy

    duplicate = copy.deepcopy(model)
    head = duplicate.get_output_embeddings()
    exact_head = None
    if precision.sample_dtype != torch.float32 and head is not None and getattr(head, "bias", None) is None:
        exact_head = Float32Head(head.weight)
    duplicate = duplicate.to(precision.sample_dtype)
    if exact_head is not None:
        duplicate.set_output_embeddings(exact_head)
        # Keep transformers from re-tying the head to the bf16 embeddings on a later tie_weights().
        duplicate.config.tie_word_embeddings = False
    return duplicate.eval()


def autocast(precision: Precision) -> torch.autocast:
    """The trainer's forward context: bf16 autocast when the policy computes in bf16, else off."""
    return torch.autocast(
        device_type=precision.device.type, dtype=precision.compute_dtype, enabled=precision.autocast
    )


__all__ = [
    "DEVICE_PATTERN",
    "DTYPES",
    "Precision",
    "autocast",
    "check_precision",
    "precision_problems",
    "resolve_device",
    "resolve_precision",
]
