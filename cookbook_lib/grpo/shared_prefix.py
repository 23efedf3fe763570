"""Shared-prefix training: forward each distinct token prefix of a micro-batch once.

Every episode of the tool-use game starts with the same ~440-token system prompt and tool block,
and the episodes of a group share their whole first prompt: padded rows would forward (and
backpropagate) those tokens once per sample, ~85% of a step's work at the demo's shape. Here the
samples of a micro-batch become one packed sequence, the *prefix tree* of their input tokens:
each distinct prefix appears once, and every token attends to exactly the tokens that precede it
in its own sample (its ancestors in the tree) through a block mask, at the position id it has in
its sample. Each token's hidden state is then the one it has in a padded row, so the log-probs,
the loss and, through the gather that reads every sample's positions out of the packed sequence
(whose backward sums the gradients of shared tokens), the gradients equal the padded path's up to
float rounding. This is the idea of Prefix Grouper (arXiv 2506.05433) generalised from a group's
one prompt to any shared prefixes, as a trie: a batch's system prompt, each group's task, and
each episode's turns when a chat template re-renders nothing.

It needs attention that takes a custom 4D mask and layers that see tokens only through attention:
:func:`tree_attention_unsupported` says why a model cannot (a recurrent or convolutional layer, a
sliding window, flash attention), and the trainer then pads as before. On a CPU the trainer also
hands the attention layers the tree's *segments* (:mod:`.tree_attention`), so that they score
only the pairs the mask allows instead of the dense ``[L, L]`` square.

Shape suffixes: ``_L`` one entry per token of the packed sequence, ``_B``/``_T`` as in
:func:`cookbook_lib.grpo.samples.collate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cookbook_lib.grpo.samples import TrainingSample

# Attention implementations that apply a 4D mask as given (transformers returns a 4D mask as is).
TREE_ATTENTION = ("sdpa", "eager")


def tree_attention_unsupported(config) -> str | None:
    """Why a model with ``config`` cannot train on packed prefix trees, or None when it can."""
    attention = getattr(config, "_attn_implementation", None)
    if attention not in TREE_ATTENTION:
        return f"its attention is {attention!r}, and only {' and '.join(TREE_ATTENTION)} take a block mask"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        others = sorted({kind for kind in layer_types if kind != "full_attention"})
        if others:
            # Recurrent and convolutional layers read the packed sequence in order, and a sliding
            # window needs its own mask per layer: neither is the tree a sample's row is.
            return f"it has {', '.join(others)} layers, and only full-attention layers read a block mask"
    elif getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "it uses a sliding attention window"
    return None


@dataclass(frozen=True)
class PrefixTree:
    """A micro-batch's input tokens as one packed sequence with each distinct prefix once.

    ``index_BT[b, t]`` is where the input token ``t`` of sample ``b`` (``collate``'s
    ``input_ids[b, t]``) sits in the packed sequence (0 at padding, which nothing reads).
    """

    input_ids_L: torch.Tensor
    position_ids_L: torch.Tensor
    ancestors_LL: torch.Tensor  # bool: row q may attend to column k
    index_BT: torch.Tensor
    # One row per sample that adds tokens, in packed order: (first new token's packed position,
    # new tokens, the sample's tokens), and those samples' packed indices concatenated: the
    # segments :mod:`.tree_attention` attends over instead of the dense mask.
    segments_S3: torch.Tensor
    segment_keys_K: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_L.shape[0])


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def packed_length(samples: Sequence[TrainingSample]) -> int:
    """The packed sequence's length for ``samples``: their input tokens with shared prefixes once."""
    inputs = sorted(sample.tokens_T[:-1] for sample in samples)
    total, previous = 0, []
    for tokens in inputs:
        total += len(tokens) - _common_prefix_length(previous, tokens)
        previous = tokens
    return total


def build_prefix_tree(samples: Sequence[TrainingSample]) -> PrefixTree:
    """The prefix tree of ``samples``' input tokens (``tokens_T[:-1]``), in ``collate``'s row order.

    Sorted lexicographically, a sample shares its longest prefix with any earlier sample with the
    one just before it, so one pass over the sorted samples builds the whole trie.
    """
    if not samples:
        raise ValueError("a prefix tree needs at least one sample")
    inputs = [sample.tokens_T[:-1] for sample in samples]
    width = max(len(tokens) for tokens in inputs)
    order = sorted(range(len(inputs)), key=lambda b: (inputs[b], b))
    packed: list[int] = []
    positions: list[int] = []
    index_BT = torch.zeros((len(inputs), width), dtype=torch.long)
    previous_tokens: list[int] = []
    previous_index: list[int] = []
    segments: list[tuple[int, int, int]] = []
    segment_keys: list[int] = []
    for b in order:
        tokens = inputs[b]
        shared = _common_prefix_length(previous_tokens, tokens)
        index = previous_index[:shared] + list(range(len(packed), len(packed) + len(tokens) - shared))
        if len(tokens) > shared:  # a duplicate, or a prefix of an earlier sample, adds no queries
            segments.append((len(packed), len(tokens) - shared, len(tokens)))
            segment_keys.extend(index)
        packed.extend(tokens[shared:])
        positions.extend(range(shared, len(tokens)))
        index_BT[b, : len(tokens)] = torch.tensor(index, dtype=torch.long)
        previous_tokens, previous_index = tokens, index
    length = len(packed)
    ancestors_LL = torch.zeros((length, length), dtype=torch.bool)
    for b, tokens in enumerate(inputs):
        index_T = index_BT[b, : len(tokens)]
        # Token t of a sample attends to its tokens 0..t: rows and columns through the index.
        causal_TT = torch.ones((len(tokens), len(tokens)), dtype=torch.bool).tril()
        ancestors_LL[index_T.unsqueeze(1), index_T.unsqueeze(0)] |= causal_TT
    return PrefixTree(
        input_ids_L=torch.tensor(packed, dtype=torch.long),
        position_ids_L=torch.tensor(positions, dtype=torch.long),
        ancestors_LL=ancestors_LL,
        index_BT=index_BT,
        segments_S3=torch.tensor(segments, dtype=torch.long).reshape(-1, 3),
        segment_keys_K=torch.tensor(segment_keys, dtype=torch.long),
    )


def attention_mask_4d(ancestors_LL: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, L, L]`` in the form ``attention`` adds or selects: bool for SDPA, additive for eager."""
    if attention == "sdpa":
        return ancestors_LL[None, None]
    blocked = torch.finfo(dtype).min
    additive = torch.zeros(ancestors_LL.shape, dtype=dtype, device=ancestors_LL.device)
    return additive.masked_fill_(~ancestors_LL, blocked)[None, None]


def pack_shared_micro_batches(
    samples: Sequence[TrainingSample], token_budget: int
) -> list[list[TrainingSample]]:
    """Greedy, deterministic packing so each micro-batch's *packed* length fits ``token_budget``.

    Samples are taken in lexicographic order of their tokens, so those sharing a prefix (a group,
    a system prompt) land in the same micro-batch and the prefix is forwarded once for all of them;
    each one costs only the tokens it adds to the tree. A sample longer than the budget gets a
    micro-batch of its own. Every sample appears exactly once.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    order = sorted(range(len(samples)), key=lambda i: (samples[i].tokens_T[:-1], i))
    batches: list[list[TrainingSample]] = []
    used = 0
    previous: list[int] = []
    for i in order:
        tokens = samples[i].tokens_T[:-1]
        added = len(tokens) - _common_prefix_length(previous, tokens)
        if batches and used + added <= token_budget:
            batches[-1].append(samples[i])
            used += added
        else:
            batches.append([samples[i]])
            used = len(tokens)
        previous = tokens
    return batches
