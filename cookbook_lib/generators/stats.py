"""What a generator's worker did: counters for metrics and tests, one record per forward pass.

The async GRPO loop reads these for its "generator busy fraction" metric and its timeline; the
tests read them to check that concurrent requests really were batched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StepKind = Literal["prefill", "decode"]


@dataclass(frozen=True)
class StepInfo:
    """One forward pass of the worker, as passed to ``step_callback`` (e.g. for a timeline)."""

    kind: StepKind
    rows: int
    start_s: float  # time.perf_counter() clock
    end_s: float
    policy_version: int
    # Prefill only: prompt tokens fed to the model, and prompt tokens whose keys and values came
    # from a kept prefix instead (prefill work saved by prefix reuse).
    prefill_tokens: int = 0
    reused_tokens: int = 0


@dataclass
class GeneratorStats:
    """Counters kept by the worker thread; read them from anywhere (they only grow)."""

    forward_calls: int = 0
    prefill_calls: int = 0
    decode_steps: int = 0
    rows_decoded: int = 0  # sum over decode steps of the rows in the batch
    max_rows: int = 0
    tokens_sampled: int = 0
    busy_s: float = 0.0  # time spent in forward passes and sampling
    prefill_tokens: int = 0  # prompt tokens fed to the model
    reused_tokens: int = 0  # prompt tokens not fed, their keys and values reused from a finished sample

    @property
    def mean_decode_batch(self) -> float:
        return self.rows_decoded / self.decode_steps if self.decode_steps else 0.0

    def record(self, step: StepInfo) -> None:
        # Each forward samples one token per row: the first token of each prefilled prompt, or
        # the next token of each decoding row.
        self.forward_calls += 1
        self.tokens_sampled += step.rows
        self.max_rows = max(self.max_rows, step.rows)
        self.busy_s += step.end_s - step.start_s
        if step.kind == "prefill":
            self.prefill_calls += 1
            self.prefill_tokens += step.prefill_tokens
            self.reused_tokens += step.reused_tokens
        else:
            self.decode_steps += 1
            self.rows_decoded += step.rows
