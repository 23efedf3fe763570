"""The record of one played episode, and the one enum that says how an episode ended.

Shape suffixes used on token fields: ``_T`` is one entry per token of the episode's sequence.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from cookbook_lib.envs.base import Task
from cookbook_lib.types import Message


class EndCause(enum.StrEnum):
    """How an episode ended: terminated by task logic, or truncated with one of four causes.

    ``ERROR`` is not a truncation: an exception escaped the environment (or its factory) and the
    episode was ended with the traceback kept; such an episode is never trained on.
    """

    TERMINATED = "TERMINATED"
    # The conversation filled ``max_model_length`` before the episode ended.
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
    # The episode hit ``max_turns`` without terminating.
    MAX_TURNS = "MAX_TURNS"
    # The environment's ``step`` returned ``truncated=True``.
    ENV = "ENV"
    # The sampled message could not be parsed; the reward is ``failed_parse_reward``.
    PARSE_FAILURE = "PARSE_FAILURE"
    ERROR = "ERROR"

    @property
    def is_truncation(self) -> bool:
        return self in _TRUNCATIONS

    @property
    def is_overlong(self) -> bool:
        """Causes that the soft overlong penalty applies to: out of context or out of turns."""
        return self in (EndCause.CONTEXT_OVERFLOW, EndCause.MAX_TURNS)


_TRUNCATIONS = frozenset(
    {EndCause.CONTEXT_OVERFLOW, EndCause.MAX_TURNS, EndCause.ENV, EndCause.PARSE_FAILURE}
)


class EpisodeError(RuntimeError):
    """Raised instead of ending the episode when the run is set to stop on environment errors."""


@dataclass
class Turn:
    """The tokens of one assistant turn, as a model policy sampled them.

    ``prompt_tokens`` is the whole prompt the turn was sampled from; ``sampled_tokens`` and
    ``logprobs`` (under the sampling distribution) are aligned; ``policy_versions`` gives the
    policy version that sampled each token (one value for all of them in lockstep).
    """

    prompt_tokens: list[int]
    sampled_tokens: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str = "stop"


@dataclass
class Episode:
    """Everything about one episode: the conversation, how it ended, its reward and diagnostics."""

    task: Task
    messages: list[Message]
    reward: float
    end_cause: EndCause
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the formatted traceback when ``end_cause`` is ERROR
    num_turns: int = 0  # assistant turns taken
    wall_time_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)

    @property
    def terminated(self) -> bool:
        return self.end_cause is EndCause.TERMINATED

    @property
    def truncated(self) -> bool:
        return self.end_cause.is_truncation

    def token_sequences(self) -> list[TokenSequence]:
        """The episode as training sequences: usually one; more where the history was rewritten."""
        return token_sequences(self.turns)

    def to_dict(self, include_tokens: bool = True) -> dict[str, Any]:
        """A JSON-ready dict (for ``episodes.jsonl``)."""
        record = asdict(self)
        record["end_cause"] = self.end_cause.value
        if not include_tokens:
            record.pop("turns")
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Episode:
        record = dict(record)
        record["task"] = Task(**record["task"])
        record["end_cause"] = EndCause(record["end_cause"])
        record["turns"] = [Turn(**turn) for turn in record.get("turns", [])]
        return cls(**record)


@dataclass
class TokenSequence:
    """One token sequence of an episode and, per token, whether the model sampled it.

    Sampled tokens carry their sampling log-prob and policy version; prompt, tool and closing
    tokens carry 0.0 and -1 and are never trained.
    """

    tokens_T: list[int]
    assistant_mask_T: list[bool]
    sampling_logprobs_T: list[float]
    policy_versions_T: list[int]

    def __len__(self) -> int:
        return len(self.tokens_T)


def token_sequences(turns: list[Turn]) -> list[TokenSequence]:
    """Stitch an episode's turns into sequences.

    Each turn's prompt normally extends the previous turn's prompt + sampled tokens (token-exact
    rendering), so the turns form one sequence. Where it does not (a chat template rewrote the
    history, e.g. dropped earlier ``<think>`` blocks), a new sequence starts, so no sequence holds
    tokens the model did not see when it sampled.
    """
    sequences: list[TokenSequence] = []
    current: TokenSequence | None = None
    for turn in turns:
        if current is None or turn.prompt_tokens[: len(current)] != current.tokens_T:
            current = TokenSequence([], [], [], [])
            sequences.append(current)
        extra = turn.prompt_tokens[len(current) :]
        current.tokens_T += extra + turn.sampled_tokens
        current.assistant_mask_T += [False] * len(extra) + [True] * len(turn.sampled_tokens)
        current.sampling_logprobs_T += [0.0] * len(extra) + list(turn.logprobs)
        current.policy_versions_T += [-1] * len(extra) + list(turn.policy_versions)
    return sequences
