"""Codecs: render a conversation and its tools to token ids; parse sampled tokens to a Message.

- :class:`ChatMLHermesCodec` renders ChatML itself, for templates that ignore ``tools=``
  (SmolLM2, the embedded default model).
- :class:`ChatTemplateCodec` renders with the tokenizer's own template and parses the reply format
  that template writes: Hermes JSON (Qwen2.5, Qwen3, Qwen3-2507), Qwen3.5+'s XML, Llama 3's JSON,
  gpt-oss's harmony channels, Gemma 4's calls, GLM's ``<arg_key>`` blocks, LFM2's pythonic calls.
- :class:`MistralCodec` renders with mistral-common, for the tokenizers transformers loads for
  Mistral models (``MistralCommonBackend``), and parses ``[TOOL_CALLS]``.
- :func:`make_codec` picks one by what the template writes, then runs the template self-check
  (:mod:`cookbook_lib.codecs.check`).

How multi-turn prompts stay token-exact, and what ``Continuation.restarted`` means, is explained
in :mod:`cookbook_lib.codecs.base`; each format's rules are in its module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs.base import Codec, Continuation, ParseResult, UnsupportedChatTemplateError
from cookbook_lib.codecs.chat_template import ChatTemplateCodec
from cookbook_lib.codecs.chatml import ChatMLHermesCodec
from cookbook_lib.codecs.check import ChatTemplateCheckError, CheckReport, check_codec
from cookbook_lib.codecs.detect import known_families, rendered_call
from cookbook_lib.codecs.mistral import MistralCodec, is_mistral_common_tokenizer
from cookbook_lib.codecs.reply import ParsedReply, ReplyFormat, ToolCallFormatError

THINKING_SWITCH = "enable_thinking"


def make_codec(
    tokenizer: PreTrainedTokenizerBase,
    *,
    enable_thinking: bool | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    check: bool = True,
) -> Codec:
    """The codec for ``tokenizer``'s chat template, checked by the template self-check.

    A template that renders assistant tool calls gets :class:`ChatTemplateCodec` with the reply
    format it writes; a ChatML template that ignores tools gets :class:`ChatMLHermesCodec`.
    Anything else raises :class:`UnsupportedChatTemplateError` with the reason and the families
    known. ``enable_thinking`` (None: the template's default) switches reasoning on or off in
    templates that have the switch (Qwen3, Qwen3.5+, GLM, Gemma 4) and is refused for others;
    ``template_kwargs`` reach every render. With ``check`` a template that fails a probe raises
    :class:`ChatTemplateCheckError` naming it.
    """
    if is_mistral_common_tokenizer(tokenizer):
        # transformers' wrapper of mistral-common (Mistral models): no jinja template to probe.
        if enable_thinking is not None or template_kwargs:
            raise UnsupportedChatTemplateError(
                "mistral-common tokenizers render without template switches; leave enable_thinking and "
                "template_kwargs unset for this model"
            )
        mistral: Codec = MistralCodec(tokenizer)
        if check:
            check_codec(mistral).raise_for_failure()
        return mistral
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise UnsupportedChatTemplateError(
            "the tokenizer has no chat template; set tokenizer.chat_template to the model's template "
            "or build a codec yourself"
        )
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        if THINKING_SWITCH not in template:
            raise UnsupportedChatTemplateError(
                f"enable_thinking={enable_thinking} was asked for, but this chat template has no "
                f"{THINKING_SWITCH} switch; leave enable_thinking unset (None) for this model"
            )
        kwargs[THINKING_SWITCH] = enable_thinking
    codec: Codec
    if _writes_tool_calls(tokenizer, kwargs):
        codec = ChatTemplateCodec(tokenizer, template_kwargs=kwargs)
    elif "<|im_start|>" in template and not kwargs:
        codec = ChatMLHermesCodec(tokenizer)
    else:
        raise UnsupportedChatTemplateError(
            "the chat template neither renders assistant tool calls nor is ChatML (<|im_start|>role ... "
            f"<|im_end|>); no codec here can render it. Known families: {known_families()}"
        )
    if check:
        check_codec(codec).raise_for_failure()
    return codec


def _writes_tool_calls(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> bool:
    def render(messages, tool_specs, generation):  # type: ignore[no-untyped-def]
        return tokenizer.apply_chat_template(
            list(messages),
            tools=list(tool_specs) or None,
            add_generation_prompt=generation,
            tokenize=False,
            **kwargs,
        )

    try:
        return rendered_call(render) is not None
    except ValueError:
        # The template raises on a tool call: ChatTemplateCodec reports why, if it is not ChatML.
        return "<|im_start|>" not in (tokenizer.chat_template or "")


__all__ = [
    "ChatMLHermesCodec",
    "ChatTemplateCheckError",
    "ChatTemplateCodec",
    "CheckReport",
    "Codec",
    "Continuation",
    "MistralCodec",
    "ParseResult",
    "ParsedReply",
    "ReplyFormat",
    "ToolCallFormatError",
    "UnsupportedChatTemplateError",
    "check_codec",
    "known_families",
    "make_codec",
]
