"""Rendering through the tokenizer's own chat template, for templates that render tools (Qwen2.5,
Qwen3, Hermes): ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``.

A template is a function of the whole conversation, so a continuation is found by difference:
render the conversation with and without the new messages and take the suffix, after checking
that the shorter render is a prefix of the longer one, in text and in tokens. Where it is not, the
template renders history differently once more messages follow. Qwen3 does it twice: it drops the
``<think>`` block of assistant turns before the last user query, and it writes an empty
``<think>`` block into the last assistant turn only while that turn is last. The second is no
rewrite of anything the model saw when the model wrote no ``<think>``, so the codec then checks
the fresh render against the prompt plus the sampled reply. Only when both checks fail is the
continuation ``restarted``: a full fresh render, and the rollout starts a new training sample there
(see :mod:`cookbook_lib.codecs.base`). With ``enable_thinking=False`` Qwen3 shows every turn an
empty ``<think>`` block and drops it from earlier turns, so every turn restarts: that is the
template's choice, and the codec follows it.

The parser is the Hermes one, so only templates that write ``<tool_call>`` JSON blocks are
accepted. Extra template variables (Qwen3's ``enable_thinking=False``) go in ``template_kwargs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs import hermes
from cookbook_lib.codecs.base import Codec, Continuation, UnsupportedChatTemplateError, check_history
from cookbook_lib.types import Message, ToolSpec

_PROBE_USER = "cookbook-probe-question"
_PROBE_REPLY = "cookbook-probe-reply"


class ChatTemplateCodec(Codec):
    """Renders with the tokenizer's chat template; parses Hermes ``<tool_call>`` blocks."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        template = tokenizer.chat_template
        if not isinstance(template, str) or hermes.TOOL_CALL_OPEN not in template:
            raise UnsupportedChatTemplateError(
                "ChatTemplateCodec needs a chat template that writes tool calls as <tool_call> blocks"
            )
        # Keep the tokenizer before discovering the closing: rendering needs it.
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self._closing_text = self._discover_turn_closing()
        super().__init__(tokenizer, turn_closing=self._closing_text)

    def render_prompt(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> list[int]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        return self._encode(self._render_text(messages, tool_specs, add_generation_prompt=True))

    def render_continuation(
        self,
        history: Sequence[Message],
        sampled_tokens: Sequence[int],
        new_messages: Sequence[Message],
        tool_specs: Sequence[ToolSpec],
    ) -> Continuation:
        check_history(history)
        after = self._render_text([*history, *new_messages], tool_specs, add_generation_prompt=True)
        after_ids = self._encode(after)
        # The history renders the same whether or not the new messages follow it.
        before = self._render_text(history, tool_specs, add_generation_prompt=False)
        suffix = self._suffix_after(before, after, after_ids)
        if suffix is None and len(history) > 1:
            # Or the fresh render starts with what the model was shown and wrote: Qwen3 writes an
            # empty <think> into a last turn that had none, and drops it once the turn is not last.
            # (Decoded only to compare; the tokens appended are the template's own.)
            prompt = self._render_text(history[:-1], tool_specs, add_generation_prompt=True)
            closed = [*sampled_tokens, *self.close_turn(sampled_tokens)]
            seen = prompt + self.tokenizer.decode(
                closed, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            suffix = self._suffix_after(seen, after, after_ids)
        if suffix is None:
            return Continuation(tokens=after_ids, restarted=True)
        return Continuation(tokens=suffix, restarted=False)

    def _suffix_after(self, prefix: str, after: str, after_ids: list[int]) -> list[int] | None:
        """The tokens of ``after`` past ``prefix``, if ``prefix`` ends a turn and begins ``after`` in
        text and in tokens (no token straddles the boundary); otherwise None."""
        if not (after.startswith(prefix) and prefix.endswith(self._closing_text)):
            return None
        prefix_ids = self._encode(prefix)
        return after_ids[len(prefix_ids) :] if after_ids[: len(prefix_ids)] == prefix_ids else None

    def render_assistant(self, message: Message) -> list[int]:
        if message["role"] != "assistant":
            raise ValueError(f"render_assistant takes an assistant message, got role {message['role']!r}")
        question = [Message(role="user", content=_PROBE_USER)]
        prompt = self._render_text(question, [], add_generation_prompt=True)
        full = self._render_text([*question, message], [], add_generation_prompt=False)
        if not (full.startswith(prompt) and full.endswith(self._closing_text)):
            raise ValueError(f"the template does not write this reply after its generation prompt: {full!r}")
        body = full[len(prompt) : len(full) - len(self._closing_text)]
        return [*self._encode(body), self.end_of_turn_id]

    def _render_text(
        self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec], *, add_generation_prompt: bool
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            [_for_template(message) for message in messages],
            tools=list(tool_specs) or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        assert isinstance(text, str)
        return text

    def _discover_turn_closing(self) -> str:
        """The text the template writes right after an assistant reply (``"<|im_end|>\\n"`` for Qwen)."""
        text = self._render_text(
            [Message(role="user", content=_PROBE_USER), Message(role="assistant", content=_PROBE_REPLY)],
            [],
            add_generation_prompt=False,
        )
        at = text.rfind(_PROBE_REPLY)
        if at == -1:
            raise UnsupportedChatTemplateError(f"the template does not write assistant replies: {text!r}")
        return text[at + len(_PROBE_REPLY) :]


def _for_template(message: Message) -> dict[str, Any]:
    """Tool-call arguments as dicts: messages carry them JSON-encoded, templates expect objects
    (Qwen's writes a string verbatim, others call ``tojson`` on it and would quote it twice)."""
    if not message.get("tool_calls"):
        return dict(message)
    calls = [
        {**call, "function": {"name": call["function"]["name"], "arguments": hermes.arguments_object(call)}}
        for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}
