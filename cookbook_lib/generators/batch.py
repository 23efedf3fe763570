"""The running batch of the transformers backend: prefill, decode steps, admitting and retiring rows.

This module is plain torch with no threads or asyncio: ``HFGenerator`` drives it from its worker
thread. Every row is left-padded: its real tokens end at the last column, the 2D attention mask
hides the padding, and each row's position ids count only its real tokens, so a row computes
what it would compute alone (up to float rounding of differently shaped matmuls).

Prefix reuse: a request admitted with a ``CachedPrefix`` starts from that prefix's keys and values
and feeds only the rest of its prompt. Such a row is laid out ``[padding, prefix, padding, rest]``:
the mask has a hole between the two parts (each part is left-padded to the longest of its kind in
the prefill), which attention never sees, and position ids count real tokens only, so the row still
computes what it would compute alone. With ``keep_finished_kv``, a finishing row's real columns are
copied out into ``Row.prefix`` for the generator to keep.

Shape suffixes: ``_B`` one entry per row, ``_L`` one per column of the padded sequence.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from cookbook_lib.generators import kv_cache
from cookbook_lib.generators.base import FinishReason, SampleResult, SamplingParams
from cookbook_lib.generators.prefix_cache import CachedPrefix
from cookbook_lib.generators.sampling import RowSampling, choose_tokens


@dataclass(eq=False)
class Request:
    """One ``sample`` call: what to sample, its random stream, and where its result goes."""

    prompt_tokens: list[int]
    params: SamplingParams
    rng: torch.Generator
    future: asyncio.Future[SampleResult]
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False  # set by the caller's task when it is cancelled; the worker drops the row


@dataclass(eq=False)
class Row:
    """A request being decoded, with what it has sampled so far."""

    request: Request
    # The position id of the newest token: the last prompt token at first; each sampled token
    # takes the next one, and is fed to the model at that position in the following step.
    position: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # False once the weights changed while the row was in flight: its keys and values then mix two
    # versions, and a prefix built from them would not match a forward pass under either.
    reusable: bool = True
    prefix: CachedPrefix | None = None  # its keys and values when it finished (keep_finished_kv)

    def append(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.policy_versions.append(version)
        self.position += 1
        params = self.request.params
        if token in params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= params.max_tokens:
            self.finish_reason = "length"

    def result(self) -> SampleResult:
        assert self.finish_reason is not None
        return SampleResult(
            list(self.tokens), list(self.logprobs), self.finish_reason, list(self.policy_versions)
        )


class PrefillBatch(abc.ABC):
    """Rows decoding together, one model forward per ``step``: what every batch shares, the prefill.

    ``admit`` prefills new requests in one forward (shared fresh prompts once, kept prefixes
    skipped), samples their first token and hands the live rows to ``_join``. How the rows'
    keys and values are held between steps is the subclass's: :class:`DecodeBatch` grows one
    cache, :class:`~cookbook_lib.generators.slot_batch.SlotDecodeBatch` keeps fixed slots.

    With ``keep_finished_kv``, every reusable row that finishes carries its keys and values out in
    ``Row.prefix`` (a copy per row, so prefix reuse costs a copy of each finished row's cache).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        device: torch.device,
        keep_finished_kv: bool = False,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.keep_finished_kv = keep_finished_kv
        self.rows: list[Row] = []
        self._last_tokens_B = torch.zeros(0, dtype=torch.long, device=device)
        # Computing logits for the last prompt position only saves a [prompt, vocab] matmul per row.
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_keyword = kv_cache.cache_keyword(model)  # its name changed in transformers 5.24

    def __len__(self) -> int:
        return len(self.rows)

    @property
    @abc.abstractmethod
    def can_admit_now(self) -> bool:
        """Whether new rows can join the running ones now."""

    @property
    @abc.abstractmethod
    def columns(self) -> int:
        """The cache's width in tokens."""

    @abc.abstractmethod
    def step(self, version: int) -> list[Row]:
        """One decode step for every row; returns the rows that finished (removed from the batch)."""

    @abc.abstractmethod
    def remove(self, indices: list[int]) -> list[Row]:
        """Take rows out of the batch (finished or cancelled)."""

    @abc.abstractmethod
    def clear(self) -> list[Row]:
        """Drop every row and what holds their keys and values; returns the dropped rows."""

    @abc.abstractmethod
    def _join(
        self, cache: DynamicCache, mask_BL: torch.Tensor, last_B: torch.Tensor, rows: list[Row]
    ) -> None:
        """Take the prefilled live ``rows`` (their ``cache`` and ``mask_BL``) in after the running ones."""

    def admit(
        self, requests: list[Request], version: int, prefixes: list[CachedPrefix | None] | None = None
    ) -> list[Row]:
        """Prefill ``requests`` in one forward, sample their first token, merge them into the batch.

        ``prefixes[i]``, when given, holds the keys and values of the first ``len(prefixes[i])``
        tokens of request ``i``'s prompt (a proper prefix of it); only the tokens after it are fed.
        The prefixes are consumed: their ``layers`` are emptied as they are copied into the batch.
        Returns the rows that finished on their first token (they never join the batch).
        """
        known = prefixes if prefixes is not None else [None] * len(requests)
        past = [len(prefix) if prefix is not None else 0 for prefix in known]
        # Identical fresh prompts (the episodes of a GRPO group all start from the task's prompt)
        # are prefilled once; their rows are copied afterwards and sampled independently.
        owner_B = list(range(len(requests)))
        if not any(past):
            first_of: dict[tuple[int, ...], int] = {}
            owner_B = [first_of.setdefault(tuple(r.prompt_tokens), len(first_of)) for r in requests]
        fed = [requests[owner_B.index(u)] for u in range(max(owner_B) + 1)]
        if len(fed) < len(requests):
            past = [0] * len(fed)  # only fresh prompts are shared, so nothing precedes them
        suffixes = [request.prompt_tokens[p:] for request, p in zip(fed, past, strict=True)]
        width_past, width = max(past), max(map(len, suffixes))
        ids_BL = torch.full((len(fed), width), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros(len(fed), width_past + width, dtype=torch.long)
        for i, suffix in enumerate(suffixes):
            ids_BL[i, width - len(suffix) :] = torch.tensor(suffix)
            mask_BL[i, width_past - past[i] : width_past] = 1
            mask_BL[i, width_past + width - len(suffix) :] = 1
        ids_BL, mask_BL = ids_BL.to(self.device), mask_BL.to(self.device)
        # Each fed token's position is the number of real tokens before it, prefix included.
        positions_BL = (mask_BL.cumsum(dim=1) - 1).clamp(min=0)[:, width_past:]
        cache = self._past_cache(known, room=width) if width_past else kv_cache.new_cache(self.model)
        extra = {"logits_to_keep": 1} if self._keep_last else {}
        output = self.model(
            input_ids=ids_BL,
            attention_mask=mask_BL,
            position_ids=positions_BL,
            use_cache=True,
            **{self._cache_keyword: cache},
            **extra,
        )
        if not kv_cache.is_filled(cache):
            raise RuntimeError(
                f"{type(self.model).__name__}.forward left the KV cache passed as `{self._cache_keyword}=` "
                "empty: this transformers version takes it under another name. Install a transformers "
                "version from the range in pyproject.toml."
            )
        logits_BV = output.logits[:, -1]
        if len(fed) < len(requests):
            expand_B = torch.tensor(owner_B, device=self.device)
            kv_cache.select_rows(cache, expand_B)
            mask_BL, logits_BV = mask_BL[expand_B], logits_BV[expand_B]
        rows = [Row(request, position=len(request.prompt_tokens) - 1) for request in requests]
        tokens_B = self._sample(rows, logits_BV, version)
        self._keep_kv(rows, cache, mask_BL)

        live = [i for i, row in enumerate(rows) if row.finish_reason is None]
        if live:
            index = torch.tensor(live, device=self.device)
            if len(live) < len(rows):
                kv_cache.select_rows(cache, index)
            self._join(cache, mask_BL[index], tokens_B[index], [rows[i] for i in live])
        return [row for row in rows if row.finish_reason is not None]

    def _partition(self, indices: list[int]) -> tuple[list[Row], list[int]]:
        """The rows at ``indices``, and the indices of the others, in order."""
        gone = set(indices)
        removed = [row for i, row in enumerate(self.rows) if i in gone]
        return removed, [i for i in range(len(self.rows)) if i not in gone]

    def _clear_rows(self) -> list[Row]:
        removed, self.rows = self.rows, []
        self._last_tokens_B = self._last_tokens_B[:0]
        return removed

    def _past_cache(self, prefixes: list[CachedPrefix | None], room: int) -> DynamicCache:
        """The prefixes' keys and values stacked into one cache with ``room`` spare columns (a row
        without one gets none). The prefixes are consumed: their layers go as they are stacked."""
        first = next(prefix for prefix in prefixes if prefix is not None)
        empty = [
            (
                keys.new_zeros(*keys.shape[:2], 0, keys.shape[3]),
                values.new_zeros(*values.shape[:2], 0, values.shape[3]),
            )
            for keys, values in first.layers
        ]
        return kv_cache.stack_rows(
            self.model,
            [prefix.layers if prefix is not None else list(empty) for prefix in prefixes],
            room=room,
            release=True,
        )

    def _keep_kv(self, rows: list[Row], cache: DynamicCache, mask_BL: torch.Tensor) -> None:
        """Copy out the keys and values of the rows that just finished, if they are to be kept.

        A row's cache covers its prompt and all its sampled tokens but the last (never fed).
        """
        if not self.keep_finished_kv:
            return
        for i, row in enumerate(rows):
            if row.finish_reason is not None and row.reusable and not row.request.cancelled:
                tokens = (*row.request.prompt_tokens, *row.tokens[:-1])
                columns = mask_BL[i].nonzero().squeeze(1)
                if columns.numel() != len(tokens):
                    raise RuntimeError(f"row cache holds {columns.numel()} tokens, expected {len(tokens)}")
                row.prefix = CachedPrefix(tokens, kv_cache.extract_row(cache, i, columns))

    def _sample(self, rows: list[Row], logits_BV: torch.Tensor, version: int) -> torch.Tensor:
        params = [row.request.params for row in rows]
        # One uniform per sampling row from its own stream; greedy rows draw none, so a seeded
        # stream advances the same way whatever shares the batch.
        uniforms = [
            0.0 if p.greedy else torch.rand((), generator=row.request.rng, dtype=torch.float64).item()
            for p, row in zip(params, rows, strict=True)
        ]
        settings = RowSampling(
            temperatures_B=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_ps_B=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            uniforms_B=torch.tensor(uniforms, dtype=torch.float64),
        )
        tokens_B, logprobs_B = choose_tokens(logits_BV, settings)
        for row, token, logprob in zip(rows, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            row.append(token, logprob, version)
        return tokens_B


class DecodeBatch(PrefillBatch):
    """Rows sharing one KV cache that grows by a column each step (the CPU's decode path)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        device: torch.device,
        keep_finished_kv: bool = False,
    ) -> None:
        super().__init__(model, pad_token_id=pad_token_id, device=device, keep_finished_kv=keep_finished_kv)
        self._cache: DynamicCache | None = None
        self._mask_BL = torch.zeros(0, 0, dtype=torch.long, device=device)

    @property
    def can_admit_now(self) -> bool:
        """Always when empty, else if the cache can be merged."""
        return self._cache is None or kv_cache.supports_merging(self._cache)

    @property
    def columns(self) -> int:
        return self._mask_BL.shape[1]

    def step(self, version: int) -> list[Row]:
        """One decode step for every row; returns the rows that finished (removed from the batch)."""
        assert self._cache is not None and self.rows, "step() on an empty batch"
        ones_B1 = torch.ones(len(self.rows), 1, dtype=torch.long, device=self.device)
        mask_BL = torch.cat([self._mask_BL, ones_B1], dim=1)
        positions_B1 = torch.tensor([[row.position] for row in self.rows], device=self.device)
        output = self.model(
            input_ids=self._last_tokens_B[:, None],
            attention_mask=mask_BL,
            position_ids=positions_B1,
            use_cache=True,
            **{self._cache_keyword: self._cache},
        )
        self._mask_BL = mask_BL
        self._last_tokens_B = self._sample(self.rows, output.logits[:, -1], version)
        self._keep_kv(self.rows, self._cache, self._mask_BL)
        return self.remove([i for i, row in enumerate(self.rows) if row.finish_reason is not None])

    def remove(self, indices: list[int]) -> list[Row]:
        """Take rows out of the batch (finished or cancelled), shrinking the cache to the rest."""
        if not indices:
            return []
        removed, others = self._partition(indices)
        if not others:
            self.clear()
            return removed
        assert self._cache is not None
        # The others, each removed row's place taken by one of the last rows: the cache moves only those.
        keep = kv_cache.order_after_removing(len(self.rows), indices)
        index = torch.tensor(keep, device=self.device)
        kv_cache.select_rows(self._cache, index)
        self.rows = [self.rows[i] for i in keep]
        self._mask_BL = self._mask_BL[index]
        self._last_tokens_B = self._last_tokens_B[index]
        self._trim_padding()
        return removed

    def clear(self) -> list[Row]:
        """Drop every row and the cache (after an error, or on shutdown); returns the dropped rows."""
        self._cache = None
        self._mask_BL = self._mask_BL[:0, :0]
        return self._clear_rows()

    def _join(
        self, cache: DynamicCache, mask_BL: torch.Tensor, last_B: torch.Tensor, rows: list[Row]
    ) -> None:
        if self._cache is None:
            self._cache, self._mask_BL, self._last_tokens_B, self.rows = cache, mask_BL, last_B, rows
            return
        kv_cache.merge(self._cache, cache)
        width = max(self.columns, mask_BL.shape[1])
        self._mask_BL = torch.cat([_left_pad(self._mask_BL, width), _left_pad(mask_BL, width)])
        self._last_tokens_B = torch.cat([self._last_tokens_B, last_B])
        self.rows = self.rows + rows

    def _trim_padding(self) -> None:
        assert self._cache is not None
        if not kv_cache.supports_merging(self._cache):
            return
        used_L = self._mask_BL.any(dim=0)
        leading = int(used_L.long().argmax()) if bool(used_L.any()) else 0
        if leading > 0:
            kv_cache.drop_leading_columns(self._cache, leading)
            self._mask_BL = self._mask_BL[:, leading:]


def _left_pad(mask_BL: torch.Tensor, width: int) -> torch.Tensor:
    pad = mask_BL.new_zeros(mask_BL.shape[0], width - mask_BL.shape[1])
    return torch.cat([pad, mask_BL], dim=1)
