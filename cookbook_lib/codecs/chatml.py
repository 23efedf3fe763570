"""ChatML rendering with Hermes-style tools, for models whose chat template ignores ``tools=``.

SmolLM2's template is plain ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) and drops the
tools it is given, so this codec renders the conversation itself:

- The tool specs go at the end of the system message, as the Hermes block Qwen2.5 uses (a system
  message is created when there is none, from the template's default system prompt if it has one).
- An assistant message is its content, then one ``<tool_call>`` block per call (see
  :mod:`cookbook_lib.codecs.hermes`), exactly what the parser reads back.
- A tool result is its own turn with the role ``tool``: ``<|im_start|>tool\\n{content}<|im_end|>\\n``,
  one per result, in the order of the calls. That is what the tokenizer's own template writes for
  a ``tool`` message, so every message the template can show is shown the same way, and a result
  cannot be mistaken for something the user wrote (Qwen2.5 puts results in a user turn instead).

For messages without tools the render is the tokenizer's template, token for token; the
constructor checks this on a probe conversation and refuses a template that differs.
Each message renders on its own, so appending messages never changes earlier turns:
``render_continuation`` is never ``restarted``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs import hermes
from cookbook_lib.codecs.base import Codec, Continuation, UnsupportedChatTemplateError, check_history
from cookbook_lib.types import Message, ToolSpec

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
_PROBE = "cookbook-probe-text"


class ChatMLHermesCodec(Codec):
    """ChatML turns, tools in the system prompt, ``<tool_call>`` JSON blocks, ``tool`` result turns."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        template = tokenizer.chat_template
        if not isinstance(template, str) or IM_START not in template:
            raise UnsupportedChatTemplateError(
                "ChatMLHermesCodec needs a ChatML chat template (<|im_start|>)"
            )
        for marker in (IM_START, IM_END):
            if len(tokenizer.encode(marker, add_special_tokens=False)) != 1:
                raise UnsupportedChatTemplateError(f"{marker} is not a single token in this tokenizer")
        super().__init__(tokenizer, turn_closing=f"{IM_END}\n", reply_format=hermes.HermesFormat())
        self.default_system_prompt: str | None = _default_system_prompt(tokenizer)
        self._check_matches_template()

    def render_prompt(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> list[int]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        return self._encode(self._render_text(messages, tool_specs) + GENERATION_PROMPT)

    def render_continuation(
        self,
        history: Sequence[Message],
        sampled_tokens: Sequence[int],
        new_messages: Sequence[Message],
        tool_specs: Sequence[ToolSpec],
    ) -> Continuation:
        check_history(history)
        text = "".join(_turn(message) for message in new_messages) + GENERATION_PROMPT
        return Continuation(tokens=self._encode(text), restarted=False)

    def render_assistant(self, message: Message) -> list[int]:
        if message["role"] != "assistant":
            raise ValueError(f"render_assistant takes an assistant message, got role {message['role']!r}")
        return [*self._encode(hermes.format_assistant_body(message)), self.end_of_turn_id]

    def _render_text(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> str:
        return "".join(_turn(message) for message in self._with_system(messages, tool_specs))

    def _with_system(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> list[Message]:
        """The messages with the system turn the render starts with: the tools block appended to it,
        and the template's default system prompt where the template would insert one."""
        rest = list(messages)
        system = (
            rest.pop(0)["content"] if rest and rest[0]["role"] == "system" else self.default_system_prompt
        )
        if tool_specs:
            block = hermes.tools_system_prompt(tool_specs)
            system = f"{system}\n\n{block}" if system else block
        return rest if system is None else [Message(role="system", content=system), *rest]

    def _check_matches_template(self) -> None:
        probes = [
            [Message(role="user", content=_PROBE)],
            [
                Message(role="system", content="S"),
                Message(role="user", content="U"),
                Message(role="assistant", content="A"),
                Message(role="user", content="V"),
            ],
        ]
        for probe in probes:
            ours = self._render_text(probe, []) + GENERATION_PROMPT
            theirs = _template_text(self.tokenizer, probe)
            if ours != theirs:
                raise UnsupportedChatTemplateError(
                    "this ChatML template renders plain messages differently from ChatMLHermesCodec:\n"
                    f"template: {theirs!r}\ncodec:    {ours!r}"
                )


def _turn(message: Message) -> str:
    role = message["role"]
    if role == "assistant":
        body = hermes.format_assistant_body(message)
    elif role in ("system", "user", "tool"):
        body = message["content"]
    else:
        raise ValueError(f"unknown message role {role!r}")
    return f"{IM_START}{role}\n{body}{IM_END}\n"


def _template_text(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return text


def _default_system_prompt(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system prompt the template inserts when the conversation has none (SmolLM2 has one)."""
    text = _template_text(tokenizer, [Message(role="user", content=_PROBE)])
    start = text.find(f"{IM_START}user\n{_PROBE}")
    if start == -1:
        raise UnsupportedChatTemplateError(f"the template does not write a ChatML user turn: {text!r}")
    if start == 0:
        return None
    match = re.fullmatch(rf"{re.escape(IM_START)}system\n(.*){re.escape(IM_END)}\n", text[:start], re.DOTALL)
    if match is None:
        raise UnsupportedChatTemplateError(f"unexpected text before the first turn: {text[:start]!r}")
    return match.group(1)
