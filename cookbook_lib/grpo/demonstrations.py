"""Turning conversations into training sequences, the way a rollout would have produced them.

A demonstration (an expert's episode) is rendered with the same codec and the same token-exact
rules as a model's rollout: assistant messages become the tokens the model would sample
(:meth:`Codec.render_assistant`), everything else is prompt. So a warm-start on demonstrations
teaches exactly the format that rollouts parse.
"""

from __future__ import annotations

from collections.abc import Sequence

from cookbook_lib.codecs import Codec
from cookbook_lib.rollout.episode import TokenSequence, Turn, token_sequences
from cookbook_lib.types import Message, ToolSpec


def conversation_turns(
    codec: Codec, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]
) -> list[Turn]:
    """The assistant turns of ``messages`` as a rollout would record them (log-probs unknown: 0)."""
    turns: list[Turn] = []
    prompt: list[int] | None = None
    rendered = 0  # messages already part of ``prompt``
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if prompt is None:
            prompt = codec.render_prompt(list(messages[:index]), list(tool_specs))
        else:
            last = turns[-1].sampled_tokens
            history, new = list(messages[:rendered]), list(messages[rendered:index])
            continuation = codec.render_continuation(history, last, new, list(tool_specs))
            prompt = (
                continuation.tokens
                if continuation.restarted
                else prompt + last + codec.close_turn(last) + continuation.tokens
            )
        sampled = codec.render_assistant(message)
        turns.append(Turn(prompt, sampled, [0.0] * len(sampled), [0] * len(sampled)))
        rendered = index + 1
    return turns


def conversation_sequences(
    codec: Codec, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]
) -> list[TokenSequence]:
    """``messages`` as training sequences with the assistant mask (usually one sequence)."""
    return token_sequences(conversation_turns(codec, messages, tool_specs))
