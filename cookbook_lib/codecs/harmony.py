"""gpt-oss's harmony format, read from the text of a sampled reply.

After the generation prompt ``<|start|>assistant`` a reply is one or more messages, each a header
and a body, joined by ``<|end|><|start|>assistant``::

    <|channel|>analysis<|message|>The user wants a, so look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"key":1}<|call|>

- ``analysis`` messages are reasoning (``Message["reasoning_content"]``);
- ``final`` messages are the answer (``content``); a reply ends with ``<|return|>`` after one;
- a ``commentary`` message addressed ``to=functions.NAME`` is a tool call with a JSON body, and
  ends the reply with ``<|call|>``; a commentary message without a recipient is a preamble the
  user may see, kept as content. The recipient may stand before or after the channel (the
  template writes ``to=`` first, models usually after), with ``json`` or ``<|constrain|>json``.

Built-in tools (``browser.*``, ``python``) are not supported: a message addressed to one is a parse
failure, as is anything that is not a harmony message. ``openai-harmony``, the format's own
library, is not used: it encodes with its own o200k tokenizer, downloads that vocabulary at first
use (impossible offline), and parses token ids of that vocabulary only; the text here is what the
model's own tokenizer decodes, so no token is ever re-encoded (see docs/architecture.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from cookbook_lib.codecs.reply import (
    ParsedReply,
    ReplyFormat,
    ToolCallFormatError,
    ToolCallTuple,
    check_name,
    check_reply_length,
    json_type,
    read_json,
)
from cookbook_lib.types import ToolSpec

START, END, MESSAGE, CHANNEL, CONSTRAIN = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_CONTENT_TYPES = {"", "json", f"{CONSTRAIN}json"}


class HarmonyFormat(ReplyFormat):
    """gpt-oss: analysis / commentary / final channels, ``to=functions.NAME`` calls."""

    name = "harmony"
    families = "gpt-oss"
    extra_stops = ("<|call|>",)
    max_calls = 1

    @property
    def has_reasoning(self) -> bool:
        return True  # the analysis channel

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return "to=functions.lookup" in rendered_call and CHANNEL in rendered_call

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        check_reply_length(text)
        analysis: list[str] = []
        final: list[str] = []
        calls: list[ToolCallTuple] = []
        segments = text.split(START)
        for number, segment in enumerate(segments, start=1):
            where = f"harmony message {number}"
            if number > 1:
                if not segment.startswith("assistant"):
                    raise ToolCallFormatError(f"{where} is not from the assistant: {segment[:60]!r}")
                segment = segment[len("assistant") :]
            if calls:
                raise ToolCallFormatError(f"{where} follows a tool call; a call ends the reply with <|call|>")
            header, separator, body = segment.partition(MESSAGE)
            if not separator:
                raise ToolCallFormatError(f"{where} has no {MESSAGE}: {segment[:80]!r}")
            ended = body.endswith(END)
            body = body.removesuffix(END)
            if not ended and number < len(segments):
                raise ToolCallFormatError(f"{where} does not end with {END} before the next message")
            if any(marker in body for marker in (MESSAGE, CHANNEL, END)):
                raise ToolCallFormatError(f"{where}'s body holds harmony markup: {body[:80]!r}")
            channel, recipient = _read_header(header, where)
            if recipient is not None:
                calls.append(_read_call(recipient, body, where, channel))
            elif channel == "analysis":
                analysis.append(body.strip())
            elif channel in ("final", "commentary"):
                final.append(body.strip())
            else:
                raise ToolCallFormatError(f"{where} is on an unknown channel {channel!r}")
        content = "\n".join(piece for piece in final if piece)
        reasoning = "\n".join(piece for piece in analysis if piece) if analysis else None
        return ParsedReply(content=content, calls=calls, reasoning=reasoning)


def _read_header(header: str, where: str) -> tuple[str, str | None]:
    channels = _CHANNEL.findall(header)
    if len(channels) != 1:
        raise ToolCallFormatError(f"{where}'s header must name one channel: {header[:80]!r}")
    recipients = _RECIPIENT.findall(header)
    if len(recipients) > 1:
        raise ToolCallFormatError(f"{where}'s header names more than one recipient: {header[:80]!r}")
    rest = _RECIPIENT.sub("", _CHANNEL.sub("", header)).replace(" ", "").strip()
    if rest not in _CONTENT_TYPES:
        raise ToolCallFormatError(f"{where}'s header has unexpected text {rest[:60]!r}")
    return channels[0], (recipients[0] if recipients else None)


def _read_call(recipient: str, body: str, where: str, channel: str) -> ToolCallTuple:
    namespace, dot, name = recipient.partition(".")
    if namespace != "functions" or not dot:
        raise ToolCallFormatError(
            f"{where} is addressed to {recipient!r}; only functions.NAME tools are supported "
            "(no built-in tools)"
        )
    if channel != "commentary":
        raise ToolCallFormatError(f"{where} calls {name!r} on the {channel} channel; calls go to commentary")
    check_name(name, where)
    arguments = read_json(body.strip(), f"{where} ({name}): the arguments")
    if not isinstance(arguments, dict):
        raise ToolCallFormatError(
            f"{where} ({name}): the arguments must be a JSON object, got {json_type(arguments)}"
        )
    return name, arguments
