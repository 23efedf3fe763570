"""Rendering through the tokenizer's own chat template, for every template that renders tool calls:
``apply_chat_template(messages, tools=..., add_generation_prompt=True)``, parsed by the reply
format the template writes (found by :mod:`cookbook_lib.codecs.detect`, or given).

A template is a function of the whole conversation, so a continuation is found by difference:
render the conversation with and without the new messages and take the suffix, after checking
that the shorter render is a prefix of the longer one, in text and in tokens, and that it ends
where the sampled reply ended (the stop token it sampled, and what the codec adds to close the
turn). Where it is not, the template renders history differently once more messages follow.
Qwen3 does it twice: it drops the ``<think>`` block of assistant turns before the last user
query, and it writes an empty ``<think>`` block into the last assistant turn only while that turn
is last. The second is no rewrite of anything the model saw when the model wrote no ``<think>``,
so the codec then checks the fresh render against the prompt plus the sampled reply. Only when
both checks fail is the continuation ``restarted``: a full fresh render, and the rollout starts a
new training sample there (see :mod:`cookbook_lib.codecs.base`). With ``enable_thinking=False``
Qwen3 shows every turn an empty ``<think>`` block and drops it from earlier turns, so every turn
restarts: that is the template's choice, and the codec follows it.

Where a format's stop tokens open the next turn (GLM's ``<|observation|>``), the sampled stop
token stands for the first token of the template's continuation, which is then left out; a
continuation that starts otherwise restarts.

Extra template variables (``enable_thinking``, ``reasoning_effort``) go in ``template_kwargs``
and reach every render.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs import detect, hermes
from cookbook_lib.codecs.base import Codec, Continuation, UnsupportedChatTemplateError, check_history
from cookbook_lib.codecs.reply import ReplyFormat
from cookbook_lib.types import Message, ToolSpec

_PROBE_USER = "cookbook-probe-question"
_PROBE_REPLY = "cookbook-probe-reply"


class ChatTemplateCodec(Codec):
    """Renders with the tokenizer's chat template; parses the reply format it writes."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        reply_format: ReplyFormat | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(tokenizer.chat_template, str) or not tokenizer.chat_template:
            raise UnsupportedChatTemplateError("ChatTemplateCodec needs a tokenizer with a chat template")
        # Keep the tokenizer before probing the template: rendering needs it.
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        if reply_format is None:
            reply_format = self._detect_format()
        self._closing_text = self._discover_turn_closing()
        super().__init__(tokenizer, turn_closing=self._closing_text, reply_format=reply_format)
        self.prompt_opens_reasoning, self.prompt_closes_reasoning = self._discover_prompt_reasoning()

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
        stopped = self.stopped_on_turn_stop(sampled_tokens)
        opens_next = stopped and self.reply_format.stops_open_next_turn
        close = self.close_turn(sampled_tokens)
        # The history renders the same whether or not the new messages follow it, and ends where
        # the sampled reply ended: its stop token and the closing the codec adds.
        tail = "" if opens_next else self._text([*sampled_tokens[-1:]] if stopped else []) + self._text(close)
        before = self._render_text(history, tool_specs, add_generation_prompt=False)
        suffix = self._suffix_after(before, after, after_ids, tail)
        if suffix is not None and opens_next:
            # The sampled stop token is the continuation's first token (GLM's <|observation|>).
            suffix = suffix[1:] if suffix[:1] == [sampled_tokens[-1]] else None
        if suffix is None and len(history) > 1:
            # Or the fresh render starts with what the model was shown and wrote: Qwen3 writes an
            # empty <think> into a last turn that had none, and drops it once the turn is not last.
            # (Decoded only to compare; the tokens appended are the template's own.)
            prompt = self._render_text(history[:-1], tool_specs, add_generation_prompt=True)
            seen = prompt + self._text([*sampled_tokens, *close])
            suffix = self._suffix_after(seen, after, after_ids, "")
        if suffix is None:
            return Continuation(tokens=after_ids, restarted=True)
        return Continuation(tokens=suffix, restarted=False)

    def _suffix_after(self, prefix: str, after: str, after_ids: list[int], tail: str) -> list[int] | None:
        """The tokens of ``after`` past ``prefix``, if ``prefix`` ends with ``tail`` and begins
        ``after`` in text and in tokens (no token straddles the boundary); otherwise None."""
        if not (after.startswith(prefix) and prefix.endswith(tail)):
            return None
        prefix_ids = self._encode(prefix)
        return after_ids[len(prefix_ids) :] if after_ids[: len(prefix_ids)] == prefix_ids else None

    def render_assistant(self, message: Message) -> list[int]:
        if message["role"] != "assistant":
            raise ValueError(f"render_assistant takes an assistant message, got role {message['role']!r}")
        question = [Message(role="user", content=_PROBE_USER)]
        prompt = self._render_text(question, [], add_generation_prompt=True)
        full = self._render_text([*question, message], [], add_generation_prompt=False)
        body = self._reply_text(prompt, full)
        if self._closing_text and body.endswith(self._closing_text):
            assert self.end_of_turn_id is not None
            return [*self._encode(body[: len(body) - len(self._closing_text)]), self.end_of_turn_id]
        for stop, stop_id in zip(self.reply_format.extra_stops, self.extra_stop_ids, strict=True):
            if body.endswith(stop):
                return [*self._encode(body[: len(body) - len(stop)]), stop_id]
        stop_after = self.reply_format.stop_after(bool(message.get("tool_calls")))
        if self.reply_format.stops_open_next_turn and stop_after is not None:
            return [*self._encode(body), self._encode(stop_after)[0]]
        raise ValueError(f"the template does not close this reply with a stop token: {body!r}")

    def _reply_text(self, prompt: str, full: str) -> str:
        """What follows the generation prompt in ``full``: the reply as the model would write it.

        Where the prompt opens a reasoning block with whitespace the template does not write into
        history (Nemotron's ``<think>\\n`` against ``<think></think>``), the reply starts right after
        the opening tag: the model, shown the whitespace, goes on from there.
        """
        if full.startswith(prompt):
            return full[len(prompt) :]
        opened = prompt.rstrip()
        tags = self.reply_format.reasoning_tags
        if (
            self.prompt_opens_reasoning
            and tags is not None
            and opened.endswith(tags.open)
            and full.startswith(opened)
        ):
            return full[len(opened) :]
        raise ValueError(f"the template does not write this reply after its generation prompt: {full!r}")

    def unrenderable(self, message: Message) -> str | None:
        try:
            self._render_text(
                [Message(role="user", content=_PROBE_USER), message], [], add_generation_prompt=False
            )
        except Exception as exc:
            return f"the chat template cannot render this reply: {exc}"
        return None

    def _render_text(
        self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec], *, add_generation_prompt: bool
    ) -> str:
        return self._render(
            [for_template(message) for message in messages], tool_specs, add_generation_prompt
        )

    def _render(
        self, messages: Sequence[dict[str, Any]], tool_specs: Sequence[ToolSpec], generation: bool
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tool_specs) or None,
            add_generation_prompt=generation,
            tokenize=False,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    def _text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _detect_format(self) -> ReplyFormat:
        try:
            written = detect.rendered_call(self._render)
        except detect.TemplateProbeError as exc:
            raise UnsupportedChatTemplateError(str(exc)) from None
        if written is None:
            raise UnsupportedChatTemplateError(
                "the chat template does not render assistant tool calls, so no codec could show a model "
                f"its own calls. Known families: {detect.known_families()}"
            )
        found = detect.reply_format_for(written, self._render)
        if found is None:
            raise UnsupportedChatTemplateError(
                f"the chat template writes tool calls as {written.strip()[:300]!r}, a form no codec here "
                f"parses. Known families: {detect.known_families()}"
            )
        return found

    def _discover_turn_closing(self) -> str:
        """The text the template writes right after a plain reply (``"<|im_end|>\\n"`` for Qwen)."""
        text = self._render_text(
            [Message(role="user", content=_PROBE_USER), Message(role="assistant", content=_PROBE_REPLY)],
            [],
            add_generation_prompt=False,
        )
        at = text.rfind(_PROBE_REPLY)
        if at == -1:
            raise UnsupportedChatTemplateError(f"the template does not write assistant replies: {text!r}")
        return text[at + len(_PROBE_REPLY) :]

    def _discover_prompt_reasoning(self) -> tuple[bool, bool]:
        """Whether the generation prompt opens a reasoning block (the reply starts inside it), and
        whether it writes an empty closed one (Qwen3's ``enable_thinking=False``)."""
        tags = self.reply_format.reasoning_tags
        if tags is None:
            return False, False
        question = [Message(role="user", content=_PROBE_USER)]
        prompt = self._render_text(question, [], add_generation_prompt=True)
        header = self._render_text(question, [], add_generation_prompt=False)
        generation = prompt[len(header) :] if prompt.startswith(header) else prompt[-200:]
        opened = generation.rfind(tags.open)
        if opened == -1:
            return False, False
        closed = generation.find(tags.close, opened) != -1
        return not closed, closed


def for_template(message: Message) -> dict[str, Any]:
    """A message as chat templates read it: tool-call arguments as dicts (messages carry them
    JSON-encoded; Qwen's template writes a string verbatim, others call ``tojson`` on it and would
    quote it twice), and reasoning also under ``thinking``, the field gpt-oss and LFM2.5 read."""
    out: dict[str, Any] = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                **call,
                "function": {"name": call["function"]["name"], "arguments": hermes.arguments_object(call)},
            }
            for call in message["tool_calls"]
        ]
    else:
        out.pop("tool_calls", None)
    if message.get("reasoning_content"):
        out["thinking"] = message["reasoning_content"]
    return out
