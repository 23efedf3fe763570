"""Codecs: render a conversation and its tools to token ids; parse sampled tokens to a Message.

- :class:`ChatMLHermesCodec` renders ChatML itself, for templates that ignore ``tools=``
  (SmolLM2, the embedded default model).
- :class:`ChatTemplateCodec` renders with the tokenizer's template, for templates that render
  tools in the Hermes ``<tool_call>`` form (Qwen2.5, Qwen3).
- :func:`make_codec` picks one from the tokenizer's template.

How multi-turn prompts stay token-exact, and what ``Continuation.restarted`` means, is explained
in :mod:`cookbook_lib.codecs.base`.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs.base import Codec, Continuation, ParseResult, UnsupportedChatTemplateError
from cookbook_lib.codecs.chat_template import ChatTemplateCodec
from cookbook_lib.codecs.chatml import ChatMLHermesCodec
from cookbook_lib.codecs.hermes import TOOL_CALL_OPEN, ToolCallFormatError


def make_codec(tokenizer: PreTrainedTokenizerBase) -> Codec:
    """The codec for ``tokenizer``'s chat template.

    A template that renders tools gets :class:`ChatTemplateCodec` (it must write ``<tool_call>``
    blocks, the form the parser reads); a ChatML template without tools gets
    :class:`ChatMLHermesCodec`. Anything else raises :class:`UnsupportedChatTemplateError`.
    """
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise UnsupportedChatTemplateError(
            "the tokenizer has no chat template; set tokenizer.chat_template to a ChatML template "
            "or build a codec yourself"
        )
    if "tools" in template:
        if TOOL_CALL_OPEN in template:
            return ChatTemplateCodec(tokenizer)
        raise UnsupportedChatTemplateError(
            "the chat template renders tools, but not as <tool_call>{json}</tool_call> blocks, the only "
            "tool-call form the codecs parse (Llama 3.1 and Mistral formats are not supported yet)"
        )
    if "<|im_start|>" in template:
        return ChatMLHermesCodec(tokenizer)
    raise UnsupportedChatTemplateError(
        "the chat template neither renders tools nor is ChatML (<|im_start|>role ... <|im_end|>); "
        "no codec here can render it"
    )


__all__ = [
    "ChatMLHermesCodec",
    "ChatTemplateCodec",
    "Codec",
    "Continuation",
    "ParseResult",
    "ToolCallFormatError",
    "UnsupportedChatTemplateError",
    "make_codec",
]
