"""Attention over a packed prefix tree that computes only the query-key pairs the tree allows.

A prefix tree (:mod:`.shared_prefix`) packs a micro-batch's samples into one sequence of ``L``
tokens, and its block mask lets each token see only its own sample's earlier tokens. Applied as a
dense ``[L, L]`` mask, SDPA still scores every pair: at the demo's shape (a 440-token system prompt
shared by 12 samples, ~2k packed tokens) the tree needs 0.95M of the 4.1M pairs, and on the
2-core CPU the dense masked attention was 30% of a training step.

Here each sample that adds tokens to the tree is one *segment*: its new tokens (one contiguous
run of the packed sequence, as :func:`.shared_prefix.build_prefix_tree` lays them out) are the
queries, and the keys are its whole sample gathered from the packed sequence (the shared prefix
it inherits, then its own run). Within a segment the mask is causal aligned to the last key; the
first segment of a tree is plain causal. Every packed position is a query of exactly one segment,
so the segments' outputs, concatenated in order, are the packed sequence's attention output, the
same as the dense mask gives (tested: outputs and gradients), for ~4x fewer scores. The gathers'
backward adds each shared key's gradient from every segment that read it.

It reaches transformers' attention layers through their ``**kwargs``: the trainer passes
:data:`SEGMENTS_KWARG` to the model's forward, and :func:`install` wraps transformers' ``sdpa``
function so that a call carrying it runs the segments; every other call (generation, other
models, any call without the keyword) goes to transformers' own function unchanged. The trainer
passes the dense mask too, so a model whose attention never sees the keyword (or a process where
another ``sdpa`` function was registered) still trains on the right pairs, only slower.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

SEGMENTS_KWARG = "prefix_tree_segments"
# Keywords whose meaning the segments do not implement: a call carrying one goes to the dense path.
_DENSE_ONLY_KWARGS = ("sliding_window", "softcap", "s_aux", "position_bias")
# SDPA's ``enable_gqa`` (torch >= 2.5) attends grouped key heads without copying them per query head.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class TreeSegments:
    """A prefix tree's segments: segment ``s`` has queries ``starts[s] : starts[s] + lengths[s]``
    of the packed sequence and keys ``key_index[s]`` (its sample's tokens, in order, ending with
    those queries). ``masks[s]`` is its ``[queries, keys]`` bool mask, None where plain causal."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    key_index: tuple[torch.Tensor, ...]
    masks: tuple[torch.Tensor | None, ...]

    @classmethod
    def from_tensors(cls, segments_S3: torch.Tensor, keys_K: torch.Tensor) -> TreeSegments:
        """From ``[S, 3]`` rows (query start, query count, key count) and the keys of every segment
        concatenated (:attr:`PrefixTree.segments_S3`, :attr:`PrefixTree.segment_keys_K`)."""
        rows = segments_S3.tolist()
        key_index = torch.split(keys_K, [keys for _, _, keys in rows])
        masks = []
        for _, queries, keys in rows:
            if queries == keys:
                masks.append(None)
            else:
                # Query i is the sample's token keys - queries + i: it sees keys up to that one.
                ones = torch.ones((queries, keys), dtype=torch.bool, device=keys_K.device)
                masks.append(ones.tril(keys - queries))
        return cls(
            starts=tuple(start for start, _, _ in rows),
            lengths=tuple(queries for _, queries, _ in rows),
            key_index=tuple(key_index),
            masks=tuple(masks),
        )


def segmented_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: TreeSegments,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``[1, H, L, D]`` attention of a packed tree's queries ``[1, H, L, D]`` over its keys and
    values ``[1, KV, L, D]`` (KV dividing H), each query seeing only its own sample's tokens.

    On a CPU, attention that SDPA would compute in bf16 or fp16 (its inputs', or autocast's) is
    computed in float32, the output in the dtype SDPA would have given. The CPU kernel's backward
    pass in bf16 runs its block products through oneDNN, which compiles a kernel for every new
    block shape, and every segment's lengths give new ones: the demo's warm-start compiled ~12k of
    them, ~10 s of its ~60 s, and their stream evicted the linears' kernels from oneDNN's bounded
    cache too (:mod:`cookbook_lib.runtime.onednn_caches`). In float32 the products go to MKL and
    nothing is compiled; a bf16 training step took 0.62x the time (``bench/bench_step.py --dtype
    auto``, docs/benchmarks.md, session 35).
    """
    compute_dtype, output_dtype = _attention_dtypes(query)
    upcast = contextlib.nullcontext()
    if compute_dtype != output_dtype:
        query, key, value = (tensor.to(compute_dtype) for tensor in (query, key, value))
        # Autocast would cast SDPA's inputs back down (SDPA is on CPU autocast's bf16 list).
        upcast = torch.autocast(device_type="cpu", enabled=False)
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1:
        if _SDPA_HAS_GQA:
            gqa = {"enable_gqa": True}
        else:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outputs = []
    with upcast:
        for start, length, index, mask in zip(
            segments.starts, segments.lengths, segments.key_index, segments.masks, strict=True
        ):
            outputs.append(
                F.scaled_dot_product_attention(
                    query[:, :, start : start + length],
                    key.index_select(2, index),
                    value.index_select(2, index),
                    attn_mask=mask,
                    dropout_p=dropout,
                    is_causal=mask is None,
                    scale=scaling,
                    **gqa,
                )
            )
    return torch.cat(outputs, dim=2).to(output_dtype)


def _attention_dtypes(query: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The dtype SDPA computes in and the one its output takes: what SDPA alone would do (its
    inputs', or autocast's), except float32 to compute on a CPU where that is bf16 or fp16 (see
    :func:`segmented_attention`). Under autocast the queries themselves may be float32 (the rotary
    embedding promotes them); autocast still casts them down inside SDPA."""
    if query.device.type != "cpu":
        return query.dtype, query.dtype
    output = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    return (torch.float32 if output in (torch.bfloat16, torch.float16) else output), output


def _sdpa_or_segments(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, or the tree's segments where the call carries them."""
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    dense_only = any(kwargs.get(name) is not None for name in _DENSE_ONLY_KWARGS)
    if segments is None or dense_only or query.shape[0] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = segmented_attention(query, key, value, segments, scaling=scaling, dropout=dropout)
    return output.transpose(1, 2).contiguous(), None


def install() -> bool:
    """Route transformers' ``sdpa`` attention through :func:`_sdpa_or_segments`; whether it is.

    Idempotent. Where another library or the user registered an ``sdpa`` function of their own,
    it is left in place and the answer is False (the trainer then keeps the dense mask alone).
    """
    current = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if current is _sdpa_or_segments:
        return True
    if current is not sdpa_attention_forward:
        return False
    AttentionInterface.register("sdpa", _sdpa_or_segments)
    return ALL_ATTENTION_FUNCTIONS.get("sdpa") is _sdpa_or_segments
