"""The generator interface: what rollouts call to sample tokens, whatever serves them.

A generator turns prompt token ids into sampled token ids with their log-probabilities, and takes
new weights tagged with a policy version. Everything crossing this interface is plain data
(lists of ints and floats, small dataclasses), so a remote replica (a Ray actor) or a vLLM engine
can sit behind it without callers changing.

Weight updates and in-flight samples: ``update_weights`` takes effect between two decode steps.
A sample already in flight keeps going under the new weights, and its ``policy_versions`` record,
token by token, which version produced each token. That is what the PIPELINE weight-sync mode
needs, and the default. (The KV cache that the old weights wrote for the earlier tokens is kept,
as in vLLM and AReaL: tokens after the switch are sampled by the new weights reading the old weights' keys and
values; their recorded log-probs are exactly that distribution.) A caller that wants whole samples
under one version (SYNCHRONOUS, BACKGROUND_PUBLISH) passes ``between_requests=True``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

import torch

from cookbook_lib.types import DEFAULT_MAX_TOKENS_PER_TURN

FinishReason = Literal["stop", "length"]


class GeneratorClosedError(RuntimeError):
    """The generator was closed before (or while) serving this request."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    ``temperature=0`` means greedy decoding. ``top_p`` keeps the smallest set of most likely tokens
    whose probability adds up to at least ``top_p`` (the nucleus) and renormalises over it.
    Sampling stops after ``max_tokens`` tokens (finish reason ``"length"``) or right after one of
    ``stop_token_ids`` is sampled (finish reason ``"stop"``; the stop token is part of the result,
    because multi-turn prompts are built from exactly the sampled tokens). ``seed`` makes one
    request reproducible on its own, whatever else is batched with it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS_PER_TURN  # as GRPOConfig.max_tokens_per_turn
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SampleResult:
    """One sampled completion; the lists are aligned, one entry per sampled token.

    ``logprobs[i]`` is the log-probability of ``tokens[i]`` under the distribution it was sampled
    from: the model's next-token distribution after temperature scaling and top-p renormalisation.
    These are the "old" log-probs of the GRPO importance ratio. For greedy decoding that
    distribution is a point mass (log-prob 0, useless as a ratio), so greedy results carry the
    temperature-1, untruncated log-probability of the chosen token instead.

    ``policy_versions[i]`` is the version of the weights that produced ``tokens[i]``; it changes
    within one sample only when weights are updated while it is in flight.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_versions: list[int]

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.logprobs) == len(self.policy_versions)):
            raise ValueError(
                f"misaligned result: {len(self.tokens)} tokens, {len(self.logprobs)} logprobs, "
                f"{len(self.policy_versions)} policy versions"
            )


class Generator(abc.ABC):
    """Samples completions for many concurrent callers; holds one policy version at a time.

    Implementations batch across concurrent ``sample`` calls however their backend does best; the
    caller just awaits one result per prompt. Use as ``async with`` to close it on exit.
    """

    @abc.abstractmethod
    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        """Sample one completion of ``prompt_tokens``. Cancelling the awaiting task drops the request."""

    @abc.abstractmethod
    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        """Load new weights, tagged ``version``; returns once tokens are being sampled with them.

        By default the weights change between two decode steps, under samples in flight (the
        PIPELINE mode). ``between_requests=True`` waits instead until the samples in flight have
        finished, starting no new one meanwhile, so every sample has one version throughout.
        The caller must not modify the tensors until this returns (they may be read meanwhile).
        """

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """The version of the weights that the next decode step will use."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving: pending and in-flight requests fail with ``GeneratorClosedError``."""

    async def sleep(self) -> None:  # noqa: B027 - optional; a no-op unless a backend needs it
        """Free the accelerator memory this generator holds, for a training step that needs it.

        Samples in flight finish first. The next ``sample`` or ``update_weights`` wakes the
        generator. The lockstep loop calls this before each optimizer step; ``HFGenerator`` lets
        go of the packed weights a shared model's routed layers keep while sampling (CPU).
        """

    async def wake_up(self) -> None:  # noqa: B027 - optional, as sleep
        """Take back what ``sleep`` freed now, rather than at the next ``sample`` (optional)."""

    async def drop_kept_prefixes(self) -> None:  # noqa: B027 - optional; a no-op where none are kept
        """Drop the KV caches kept for prefix reuse (``HFGenerator``'s ``prefix_cache_*``), now.

        For a caller that knows no kept sequence will be extended: when every episode of a phase
        has ended (a lockstep step's sampling, a validation), its last turns' caches are kept but
        dead until newer ones push them out of the bound, and a training step or the next phase's
        caches would be allocated on top of them. Samples in flight are unaffected.
        """

    def forget_prefix(self, tokens: Sequence[int]) -> None:  # noqa: B027 - optional, as above
        """No turn will extend ``tokens`` (a prompt and all but the last token sampled for it):
        drop the KV cache kept for them, if any. Called when an episode ends, so its last turn's
        cache goes at once rather than staying to the end of the phase. Never blocks; may be
        called from any thread."""

    async def __aenter__(self) -> Generator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


def validate_prompt(prompt_tokens: list[int], vocab_size: int | None = None) -> None:
    """Fail early, in the caller's task, on prompts a backend would choke on later."""
    if len(prompt_tokens) == 0:
        raise ValueError("prompt_tokens is empty; a prompt needs at least one token")
    for token in prompt_tokens:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"prompt tokens must be non-negative integers, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(f"prompt token {token} is outside the vocabulary (size {vocab_size})")
