"""Mistral models, rendered by mistral-common and parsed here.

transformers 5 loads Mistral tokenizers as ``MistralCommonBackend``: a wrapper around
mistral-common's ``MistralTokenizer``, with no jinja chat template (``chat_template`` is None).
mistral-common is the format's own library, so :class:`MistralCodec` renders every conversation
with it, straight to token ids (``encode_chat_completion``), never through text: mistral-common
never reads special tokens out of text, so a rendered text could not be encoded back (transformers
warns that ``apply_chat_template(tokenize=False)`` is unsafe for the same reason).

What the tokenizer versions write (the final ``</s>`` is the stop token; nothing follows it)::

    v3   [INST]...[/INST][TOOL_CALLS][{"name": "lookup", "arguments": {"key": "a"}, "id": "Ab3dE5gH7"}]</s>
    v7   [INST]...[/INST]Let me look.[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]</s>
    v11  [INST]...[/INST]Let me look.[TOOL_CALLS]lookup[CALL_ID]Ab3dE5gH7[ARGS]{"key": "a"}</s>
    v13  [INST]...[/INST][THINK]reasoning[/THINK]Let me look.[TOOL_CALLS]lookup[ARGS]{"key": "a"}</s>

with one ``[TOOL_CALLS]name[ARGS]{...}`` per call from v11 on. v3 writes a turn with content or
calls, never both; v7 and later write content first. ``[THINK]`` blocks exist from v13 on, in
tokenizers that have the two tokens (Magistral); then ``has_reasoning`` is True, else False.
v2 is refused (it renders one tool result per turn and drops tool turns before the last user
message), as is v1 (no tool calls). v15 (model settings, ``reasoning_effort``) is taken as v13 but
untested: no v15 tokenizer file was at hand, and none is built in the tests.

Rendering history. ``apply_chat_template`` (mistral-common's "test" mode) refuses a conversation
that ends with an assistant turn, which the codec must render to find continuations and the
tokens of a demonstration. The codec keeps a second ``MistralTokenizer`` around the same instruct
tokenizer, with mistral-common's "agnostic" validator: every content check (tool-call ids,
function names, message order), no rule on the last role. The tokens are the same; only the
validation differs.

Continuations are found by difference on token ids: the render of ``history + new`` must start
with the render of ``history``, which must end with ``</s>``; else the continuation restarts
(see :mod:`cookbook_lib.codecs.base`). Tool results never rewrite history. A new user message
does up to v11: the tools block (and in v3 the system prompt) is written before the *last* user
message, so it moves. From v13 the tools stand before the first one and nothing restarts.

Parsing is ours: mistral-common 1.13 has no parser for sampled replies beyond private helpers in
``mistral_common.experimental.tools``, which read the calls with plain ``json.loads`` (unbounded
nesting and numbers, ``NaN`` accepted), take any extra keys, and raise assorted exceptions.
:class:`MistralFormat` reads the text strictly (exact keys, arguments a JSON object, read by
:func:`cookbook_lib.plain_json.loads_plain_json`), in bounded time, raising only
:class:`ToolCallFormatError`. The text is decoded with special tokens kept *as text*: for
sentencepiece tokenizers both ``decode(skip_special_tokens=False)`` and mistral-common's
``SpecialTokenPolicy.KEEP`` return raw pieces (``▁``, ``<0x0A>``), so :meth:`MistralCodec.decode_text`
decodes the runs between special tokens with sentencepiece itself; tekken's ``KEEP`` is true text.

Tool-call ids. v3 to v11 render the id of each call (the ``"id"`` key, ``[CALL_ID]``), so the
model writes one: the parse keeps it, and the history renders as it was sampled. A call written
without an id gets a fresh one of the form mistral-common demands (9 letters and digits). The
rollout keeps the model's own tokens (no id) and appends the tool result, which names the fresh
id (v3: ``"call_id"``, v7/v11: after ``[TOOL_RESULTS]``); a fresh render of that history shows
the id inside the call too, as Mistral's serving stacks do when they send generated ids back. v13
renders no ids at all. An id mistral-common would refuse in a message (``call_0``, OpenAI's
``call_...``) is rendered as a 9-character digest of itself, the same in the call and in its
result, so they still pair.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from cookbook_lib.codecs import hermes
from cookbook_lib.codecs.base import (
    Codec,
    Continuation,
    UnsupportedChatTemplateError,
    check_history,
)
from cookbook_lib.codecs.reply import (
    ParsedReply,
    ReasoningTags,
    ReplyFormat,
    ToolCallFormatError,
    ToolCallTuple,
    check_reply_length,
    json_type,
    read_call_object,
    read_json,
)
from cookbook_lib.plain_json import MAX_JSON_DEPTH
from cookbook_lib.types import Message, ToolSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EOS = "</s>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
THINK_TAGS = ReasoningTags("[THINK]", "[/THINK]")

# mistral-common's own rules (protocol/instruct/validator.py): a call id is exactly 9 letters or
# digits (v3 to v11), a function name 1 to 64 of [a-zA-Z0-9_-]. A reply breaking them could not
# be rendered back, so the parser refuses it with the reason.
_CALL_ID = re.compile(r"[a-zA-Z0-9]{9}")
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ID_ALPHABET = string.ascii_letters + string.digits
_WHITESPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()

_PROBE_USER = "cookbook-probe-question"


@dataclass(frozen=True)
class MistralReply(ParsedReply):
    """A parsed reply plus the id the model wrote for each call (None where it wrote none)."""

    ids: tuple[str | None, ...] = ()


class MistralFormat(ReplyFormat):
    """``content[TOOL_CALLS][{...}, ...]`` (v3, v7) or ``content[TOOL_CALLS]name[ARGS]{...}...``
    (v11 and later), optionally after a ``[THINK]`` block (v13+ with think tokens)."""

    name = "mistral"
    families = (
        "Mistral (mistral-common tokenizers v3 to v13: Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small, "
        "Large, Ministral, Pixtral, Magistral, Devstral)"
    )

    def __init__(
        self,
        *,
        calls_as: Literal["json", "args"] = "json",
        call_ids: bool = True,
        content_with_calls: bool = True,
        think: bool = False,
    ) -> None:
        """``calls_as``: one JSON list after ``[TOOL_CALLS]`` (v2 to v7) or ``[TOOL_CALLS]name[ARGS]``
        per call (v11+). ``call_ids``: whether calls may carry an id (an ``"id"`` key, or
        ``[CALL_ID]``; v13 writes none). ``content_with_calls``: whether text may precede the
        calls (v3 renders a turn with one or the other). ``think``: ``[THINK]`` blocks (v13+)."""
        self.calls_as = calls_as
        self.call_ids = call_ids
        self.content_with_calls = content_with_calls
        self.reasoning_tags = THINK_TAGS if think else None

    @classmethod
    def writes(cls, rendered_call: str) -> bool:
        return TOOL_CALLS in rendered_call

    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> MistralReply:
        check_reply_length(text)
        reasoning = None
        # Mistral's prompts never open a [THINK] block, so a reply has one only if it starts with
        # [THINK]; a lone [/THINK] later (inside arguments, say) is not the end of one.
        tags = self.reasoning_tags
        if tags is not None and (in_reasoning or text.lstrip().startswith(tags.open)):
            reasoning, text = tags.split(text, in_reasoning=in_reasoning)
        at = text.find(TOOL_CALLS)
        head = text if at == -1 else text[:at]
        if self.calls_as == "args":
            for marker in (ARGS, CALL_ID):
                if marker in head:
                    raise ToolCallFormatError(f"stray {marker} with no {TOOL_CALLS} before it")
        content = head.strip()
        if at == -1:
            return MistralReply(content=content, reasoning=reasoning)
        if content and not self.content_with_calls:
            raise ToolCallFormatError(
                f"the reply has text before {TOOL_CALLS} ({content[:80]!r}); this tokenizer version (v3) "
                "renders a turn with either text or tool calls, not both"
            )
        start = at + len(TOOL_CALLS)
        calls, ids = (
            self._json_calls(text, start) if self.calls_as == "json" else self._args_calls(text, start)
        )
        return MistralReply(content=content, calls=calls, reasoning=reasoning, ids=tuple(ids))

    def _json_calls(self, text: str, start: int) -> tuple[list[ToolCallTuple], list[str | None]]:
        value, end = _read_json(text, start, f"the tool calls after {TOOL_CALLS}")
        rest = text[end:].strip()
        if rest:
            raise ToolCallFormatError(
                f"text after the tool calls ({rest[:80]!r}): {TOOL_CALLS} is followed by one JSON list, "
                "which ends the reply"
            )
        if not isinstance(value, list):
            raise ToolCallFormatError(
                f'{TOOL_CALLS} must be followed by a JSON list [{{"name": ..., "arguments": {{...}}}}, ...], '
                f"got {json_type(value)}"
            )
        if not value:
            raise ToolCallFormatError(f"{TOOL_CALLS} is followed by an empty list of calls")
        extra_keys = ("id",) if self.call_ids else ()
        calls: list[ToolCallTuple] = []
        ids: list[str | None] = []
        for number, item in enumerate(value, start=1):
            where = f"tool call {number}"
            name, arguments = read_call_object(
                item, where, extra_keys=extra_keys, name_rule=_check_function_name
            )
            calls.append((name, arguments))
            ids.append(_check_call_id(item["id"], where) if "id" in item else None)
        _check_unique(ids)
        return calls, ids

    def _args_calls(self, text: str, start: int) -> tuple[list[ToolCallTuple], list[str | None]]:
        calls: list[ToolCallTuple] = []
        ids: list[str | None] = []
        position = start  # just after a [TOOL_CALLS]
        while True:
            where = f"tool call {len(calls) + 1}"
            args_at = text.find(ARGS, position)
            next_call = text.find(TOOL_CALLS, position)
            if args_at == -1 or (next_call != -1 and next_call < args_at):
                raise ToolCallFormatError(
                    f"{where} has no {ARGS} after its name: {text[position : position + 80]!r}"
                )
            header = text[position:args_at]
            call_id: str | None = None
            if CALL_ID in header:
                if not self.call_ids:
                    raise ToolCallFormatError(
                        f"{where} has a {CALL_ID}; this tokenizer version writes no call ids"
                    )
                header, _, raw_id = header.partition(CALL_ID)
                call_id = _check_call_id(raw_id.strip(), where)
            name = _check_function_name(header.strip(), where)
            arguments, end = _read_json(text, args_at + len(ARGS), f"{where} ({name}): the arguments")
            if not isinstance(arguments, dict):
                raise ToolCallFormatError(
                    f"{where} ({name}): the arguments must be a JSON object, got {json_type(arguments)}"
                )
            calls.append((name, arguments))
            ids.append(call_id)
            after = _WHITESPACE.match(text, end)
            position = after.end() if after is not None else end
            if position == len(text):
                break
            if not text.startswith(TOOL_CALLS, position):
                raise ToolCallFormatError(
                    f"text after {where} ({text[position : position + 80]!r}); only another {TOOL_CALLS} "
                    "may follow"
                )
            position += len(TOOL_CALLS)
        _check_unique(ids)
        return calls, ids


def _read_json(text: str, start: int, where: str) -> tuple[Any, int]:
    """The JSON value starting at ``start`` (after whitespace) and the index just past it.

    ``raw_decode`` finds where the value ends (a JSON string may hold ``[TOOL_CALLS]``, so no
    search for the next marker could); the value is then read again by ``loads_plain_json`` for
    its bounds (depth, number size, no ``NaN``, no lone surrogates) by :func:`read_json`.
    """
    after = _WHITESPACE.match(text, start)
    begin = after.end() if after is not None else start
    try:
        _, end = _DECODER.raw_decode(text, begin)
    except json.JSONDecodeError as exc:
        snippet = text[begin : begin + 200]
        raise ToolCallFormatError(f"{where} are not valid JSON ({exc.msg}): {snippet!r}") from None
    except RecursionError:
        raise ToolCallFormatError(
            f"{where}: the JSON is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    except ValueError as exc:  # Python's limit on the digits of an integer
        raise ToolCallFormatError(f"{where} are not plain JSON: {exc}") from None
    return read_json(text[begin:end], where), end


def _check_function_name(name: object, where: str) -> str:
    if not isinstance(name, str):
        raise ToolCallFormatError(f'{where}: "name" must be a string, got {json_type(name)}')
    if not _FUNCTION_NAME.fullmatch(name):
        raise ToolCallFormatError(
            f"{where}: {name[:80]!r} is not a tool name mistral-common accepts (1 to 64 of a-z, A-Z, "
            "0-9, _ and -)"
        )
    return name


def _check_call_id(call_id: object, where: str) -> str:
    if not isinstance(call_id, str) or not _CALL_ID.fullmatch(call_id):
        shown = repr(call_id[:40]) if isinstance(call_id, str) else json_type(call_id)
        raise ToolCallFormatError(
            f"{where}: the call id {shown} is not 9 letters or digits, as mistral-common requires"
        )
    return call_id


def _check_unique(ids: Sequence[str | None]) -> None:
    written = [call_id for call_id in ids if call_id is not None]
    if len(set(written)) != len(written):
        raise ToolCallFormatError(
            "two tool calls of the reply have the same id; their results could not be told apart"
        )


def mistral_call_id(call_id: str) -> str:
    """``call_id`` if mistral-common accepts it, else a 9-character alphanumeric digest of it
    (the same for the call and for its result, so they still pair)."""
    if _CALL_ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    characters = []
    for _ in range(9):  # 62**9 < 2**64: nine base-62 digits of the first 8 bytes
        number, digit = divmod(number, len(_ID_ALPHABET))
        characters.append(_ID_ALPHABET[digit])
    return "".join(characters)


def is_mistral_common_tokenizer(tokenizer: object) -> bool:
    """Whether ``tokenizer`` is transformers' ``MistralCommonBackend`` (checked by class, so that
    mistral-common need not be importable to ask)."""
    return any(
        cls.__name__ == "MistralCommonBackend" and cls.__module__.endswith("tokenization_mistral_common")
        for cls in type(tokenizer).__mro__
    )


def _version_number(version: Any) -> int:
    return int(str(version.value).lstrip("v"))


class MistralCodec(Codec):
    """Renders with mistral-common (token ids, never text) and parses :class:`MistralFormat`.

    ``version`` is the mistral-common tokenizer version as a number (3, 7, 11, 13, 15).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, call_id_seed: int = 0) -> None:
        """``tokenizer``: a ``MistralCommonBackend``. ``call_id_seed`` seeds the fresh ids given
        to calls the model wrote without one (fixed by default, so runs repeat)."""
        from mistral_common.protocol.instruct.normalize import get_normalizer
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        mistral = getattr(tokenizer, "tokenizer", None)
        if not is_mistral_common_tokenizer(tokenizer) or not isinstance(mistral, MistralTokenizer):
            raise UnsupportedChatTemplateError(
                "MistralCodec needs transformers' MistralCommonBackend tokenizer (a mistral-common tokenizer)"
            )
        raw = mistral.instruct_tokenizer.tokenizer
        self.version = _version_number(raw.version)
        if self.version < 3:
            raise UnsupportedChatTemplateError(
                f"mistral-common tokenizer v{self.version} is not supported: v1 renders no tool calls, v2 "
                "one tool result per turn (and drops tool turns before the last user message); v3 and "
                "later are"
            )
        self.tokenizer = tokenizer
        self._raw = raw
        self._is_tekken = isinstance(raw, Tekkenizer)
        self._special_ids = frozenset(int(token) for token in raw.special_ids)
        self._vocab_size = int(raw.n_words)
        builder = raw.model_settings_builder if raw.version.supports_model_settings else None
        # Same instruct tokenizer (same tokens), "agnostic" validation: every content check, but
        # a conversation may end with an assistant turn (history, demonstrations).
        self._renderer = MistralTokenizer(
            mistral.instruct_tokenizer,
            validator=get_validator(raw.version, mode=ValidationMode.agnostic),
            request_normalizer=get_normalizer(raw.version, builder),
        )
        self._request_type = ChatCompletionRequest
        think = self.version >= 13 and all(raw.is_special(tag) for tag in (THINK_TAGS.open, THINK_TAGS.close))
        reply_format = MistralFormat(
            calls_as="json" if self.version <= 7 else "args",
            call_ids=self.version <= 11,
            content_with_calls=self.version >= 7,
            think=think,
        )
        super().__init__(tokenizer, turn_closing=EOS, reply_format=reply_format)
        self._id_random = random.Random(call_id_seed)

    # -- rendering -------------------------------------------------------------------------------

    def render_prompt(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> list[int]:
        if not messages:
            raise ValueError("cannot render an empty conversation")
        if messages[-1]["role"] == "assistant":
            raise ValueError("a prompt ends with a user or tool message, not with an assistant turn")
        return self._render(messages, tool_specs)

    def render_continuation(
        self,
        history: Sequence[Message],
        sampled_tokens: Sequence[int],
        new_messages: Sequence[Message],
        tool_specs: Sequence[ToolSpec],
    ) -> Continuation:
        check_history(history)
        after = self.render_prompt([*history, *new_messages], tool_specs)
        before = self._render(history, tool_specs)
        # The history renders the same with the new messages after it, and ends with </s>, as the
        # sequence so far does (sampled + close_turn).
        if before and before[-1] == self.end_of_turn_id and after[: len(before)] == before:
            return Continuation(tokens=after[len(before) :], restarted=False)
        return Continuation(tokens=after, restarted=True)

    def render_assistant(self, message: Message) -> list[int]:
        if message["role"] != "assistant":
            raise ValueError(f"render_assistant takes an assistant message, got role {message['role']!r}")
        question = [Message(role="user", content=_PROBE_USER)]
        prompt = self._render(question, [])
        full = self._render([*question, message], [])
        if full[: len(prompt)] != prompt or full[-1:] != [self.end_of_turn_id]:
            raise ValueError("mistral-common does not render this reply after its prompt, ending with </s>")
        return full[len(prompt) :]

    def unrenderable(self, message: Message) -> str | None:
        try:
            self._render([Message(role="user", content=_PROBE_USER), message], [], what="reply")
        except ValueError as exc:
            return str(exc)
        return None

    def _render(
        self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec], *, what: str = "conversation"
    ) -> list[int]:
        try:
            request = self._request_type.from_openai(
                messages=[self._for_mistral(message) for message in messages],
                tools=[dict(spec) for spec in tool_specs] or None,
            )
            return [int(token) for token in self._renderer.encode_chat_completion(request).tokens]
        except Exception as exc:
            # mistral-common says no in many ways (its own exceptions, pydantic's, assertions):
            # to callers all are one refusal of this conversation.
            raise ValueError(
                f"mistral-common cannot render this {what}: {type(exc).__name__}: {exc}"
            ) from exc

    def _for_mistral(self, message: Message) -> dict[str, Any]:
        """A message as mistral-common's ``from_openai`` reads it."""
        role = message["role"]
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
            calls = message.get("tool_calls") or []
            if calls:
                out["tool_calls"] = [
                    {
                        "id": mistral_call_id(call["id"]),
                        "type": "function",
                        "function": {
                            "name": call["function"]["name"],
                            # Checked to be a JSON object as for every codec; mistral-common
                            # writes it again its own way.
                            "arguments": json.dumps(hermes.arguments_object(call), ensure_ascii=False),
                        },
                    }
                    for call in calls
                ]
            # Only where the tokenizer renders [THINK]; elsewhere, as templates do, reasoning is not shown.
            if self.reply_format.has_reasoning and "reasoning_content" in message:
                out["reasoning_content"] = message["reasoning_content"]
            return out
        if role == "tool":
            return {
                "role": "tool",
                "content": message["content"],
                "tool_call_id": mistral_call_id(message.get("tool_call_id", "")),
                "name": message.get("name"),
            }
        return {"role": role, "content": message["content"]}

    # -- tokens and text -------------------------------------------------------------------------

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` with special tokens kept as their names (``[TOOL_CALLS]``):
        real text, not sentencepiece's pieces. Raises ValueError for ids outside the vocabulary."""
        ids = [int(token) for token in token_ids]
        for token in ids:
            if not 0 <= token < self._vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary (0 to {self._vocab_size - 1})")
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        if self._is_tekken:
            return str(self._raw.decode(ids, special_token_policy=SpecialTokenPolicy.KEEP))
        pieces: list[str] = []
        run: list[int] = []
        for token in ids:
            if token in self._special_ids:
                if run:
                    pieces.append(self._raw.decode(run, special_token_policy=SpecialTokenPolicy.IGNORE))
                    run = []
                pieces.append(self._raw.id_to_piece(token))
            else:
                run.append(token)
        if run:
            pieces.append(self._raw.decode(run, special_token_policy=SpecialTokenPolicy.IGNORE))
        return "".join(pieces)

    def _encode(self, text: str) -> list[int]:
        # For the base class's closing ("</s>"): mistral-common never reads special tokens out of
        # text, so a special token's name maps to its id here.
        if self._raw.is_special(text):
            return [int(self._raw.get_special_token(text))]
        return [int(token) for token in self._raw.encode(text, bos=False, eos=False)]

    def _is_added(self, token_id: int) -> bool:
        # MistralCommonBackend has no added vocabulary; its special tokens are mistral-common's.
        return token_id in self._special_ids

    # -- parsing ---------------------------------------------------------------------------------

    def new_call_id(self) -> str:
        """A fresh call id as mistral-common demands: 9 random letters and digits (seeded)."""
        return "".join(self._id_random.choices(_ID_ALPHABET, k=9))

    def call_ids(self, reply: ParsedReply) -> list[str]:
        """The ids the model wrote (v3 to v11 render them, so the history renders as sampled), and
        a :meth:`new_call_id` for a call written without one."""
        written = list(reply.ids) if isinstance(reply, MistralReply) else []
        written += [None] * (len(reply.calls) - len(written))
        taken = {call_id for call_id in written if call_id is not None}
        ids: list[str] = []
        for call_id in written[: len(reply.calls)]:
            if call_id is None:
                call_id = self.new_call_id()
                while call_id in taken:
                    call_id = self.new_call_id()
                taken.add(call_id)
            ids.append(call_id)
        return ids
