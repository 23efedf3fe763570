"""A policy backed by a language model: render, sample, parse, with token-exact prompts.

One :class:`ModelPolicy` plays one episode. Its first call renders the whole conversation; each
later call extends the previous prompt with exactly the tokens the model sampled, the tokens that
close that turn, and the rendered messages the environment added since. Text is never decoded and
re-encoded, so the tokens we train on are the tokens that were sampled.

End causes it reports (see :class:`cookbook_lib.rollout.episode.EndCause`):

* ``CONTEXT_OVERFLOW``: the prompt (including a long tool output) leaves no room to sample under
  ``max_model_length``, or sampling ran into that limit before the turn ended.
* ``PARSE_FAILURE``: the reply could not be parsed (an unclosed ``<tool_call>``, invalid JSON...).

A reply cut by the per-turn budget (``sampling.max_tokens``) but not by the context is parsed as
it is: the environment decides what an incomplete answer is worth.

Whatever the model writes ends as a message or a ``PARSE_FAILURE`` (``Codec.parse`` never raises).
Should anything here raise all the same, the policy is a :class:`~cookbook_lib.rollout.play.ContainedPolicy`:
the episode ends as ``ERROR`` with the traceback kept and the run goes on, except when the
generator was closed (the run is shutting down), which propagates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from cookbook_lib.codecs import Codec
from cookbook_lib.generators import Generator, GeneratorClosedError, SamplingParams
from cookbook_lib.rollout.episode import EndCause, Turn
from cookbook_lib.rollout.play import ContainedPolicy, PolicyStep
from cookbook_lib.types import Message, ToolSpec


class ModelPolicy(ContainedPolicy):
    """The policy of one episode: holds that episode's prompt tokens between turns."""

    # A closed generator means the run is stopping: that must unwind the run, not end one episode.
    propagating_errors: ClassVar[tuple[type[Exception], ...]] = (GeneratorClosedError,)

    def __init__(
        self, generator: Generator, codec: Codec, sampling: SamplingParams, max_model_length: int
    ) -> None:
        self.generator = generator
        self.codec = codec
        self.sampling = replace(
            sampling, stop_token_ids=sorted(set(sampling.stop_token_ids) | set(codec.stop_token_ids))
        )
        self.max_model_length = max_model_length
        self._last_prompt: list[int] | None = None
        self._last_sampled: list[int] = []
        self._messages_rendered = 0

    def _next_prompt(self, messages: list[Message], tool_specs: list[ToolSpec]) -> list[int]:
        if self._last_prompt is None:
            return self.codec.render_prompt(messages, tool_specs)
        history, new_messages = messages[: self._messages_rendered], messages[self._messages_rendered :]
        continuation = self.codec.render_continuation(history, self._last_sampled, new_messages, tool_specs)
        if continuation.restarted:
            # The template rewrote the history: this prompt starts a new training sequence.
            return continuation.tokens
        return (
            self._last_prompt
            + self._last_sampled
            + self.codec.close_turn(self._last_sampled)
            + continuation.tokens
        )

    def finish(self) -> None:
        # The generator kept the last turn's KV cache (its prompt and all but its last sampled
        # token) for a next turn that will not come: ~10-20 MB an episode on the embedded model.
        if self._last_prompt is not None and self._last_sampled:
            self.generator.forget_prefix(self._last_prompt + self._last_sampled[:-1])

    async def __call__(self, messages: list[Message], tool_specs: list[ToolSpec]) -> PolicyStep:
        prompt = self._next_prompt(messages, tool_specs)
        room = self.max_model_length - len(prompt)
        if room <= 0:
            return PolicyStep(message=None, end_cause=EndCause.CONTEXT_OVERFLOW)
        budget = min(self.sampling.max_tokens, room)
        result = await self.generator.sample(prompt, replace(self.sampling, max_tokens=budget))
        turn = Turn(
            prompt_tokens=prompt,
            sampled_tokens=list(result.tokens),
            logprobs=list(result.logprobs),
            policy_versions=list(result.policy_versions),
            finish_reason=result.finish_reason,
        )
        self._last_prompt, self._last_sampled = prompt, turn.sampled_tokens
        # The env appends our message to its history; the messages after it are new next time.
        self._messages_rendered = len(messages) + 1
        parsed = self.codec.parse(turn.sampled_tokens, tool_specs)
        if (
            result.finish_reason == "length"
            and len(prompt) + len(turn.sampled_tokens) >= self.max_model_length
        ):
            raw = Message(role="assistant", content=parsed.text)
            return PolicyStep(message=raw, end_cause=EndCause.CONTEXT_OVERFLOW, turn=turn)
        if parsed.message is None:
            raw = Message(role="assistant", content=parsed.text)
            return PolicyStep(message=raw, end_cause=EndCause.PARSE_FAILURE, turn=turn)
        return PolicyStep(message=parsed.message, turn=turn)
