"""What every reply format shares: the parsed reply, its one error type, and the rules for reasoning
blocks, typed parameter values and bounded parsing.

A *reply format* is how one model family writes an assistant turn as text: where its reasoning
goes, how it writes a tool call, and which tokens end the turn. Each format module in this package
(:mod:`~cookbook_lib.codecs.hermes`, :mod:`~cookbook_lib.codecs.qwen_xml`, ...) has a
:class:`ReplyFormat` that says whether a template's rendering of a probe call is in its form
(:meth:`ReplyFormat.writes`) and reads a sampled reply back (:meth:`ReplyFormat.parse`). The codecs
add the tokenizer and the template; formats only see text.

A reply is untrusted input: :meth:`ReplyFormat.parse` raises :class:`ToolCallFormatError` and
nothing else for any text, and refuses a reply longer than :data:`MAX_REPLY_CHARS` before
scanning it, so one parse takes bounded time.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cookbook_lib.plain_json import MAX_JSON_CHARS, PlainJSONError, loads_plain_json
from cookbook_lib.types import ToolSpec

# Longest reply text parsed (about 50k tokens of ordinary text, far above any per-turn sampling
# budget): every step of a parser is linear in it, so this bounds the time of one parse.
MAX_REPLY_CHARS = MAX_JSON_CHARS


class ToolCallFormatError(ValueError):
    """A reply that does not follow its format; the message says what is wrong."""


ToolCallTuple = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class ParsedReply:
    """A reply read back: the answer, the reasoning (None when the reply has no reasoning block)
    and the tool calls as ``(name, arguments)``."""

    content: str
    calls: list[ToolCallTuple] = field(default_factory=list)
    reasoning: str | None = None


@dataclass(frozen=True)
class ReasoningTags:
    """The markup around a reasoning block, e.g. ``<think>`` / ``</think>``."""

    open: str
    close: str

    def split(self, text: str, *, in_reasoning: bool) -> tuple[str | None, str]:
        """``(reasoning, rest)``. The reasoning is the text before the first closing tag (after an
        opening tag if the reply starts with one), stripped; None when the reply has no block.

        A closing tag with no opening tag before it means the prompt opened the block (Qwen3.6
        prompts end with ``<think>\\n``). With ``in_reasoning`` and no closing tag at all, the
        whole reply is reasoning: the model was cut off, or stopped, before answering.
        """
        stripped = text.lstrip()
        opened = stripped.startswith(self.open)
        body = stripped[len(self.open) :] if opened else text
        close_at = body.find(self.close)
        if close_at == -1:
            if opened or in_reasoning:
                return _clean(body), ""
            return None, text
        if not opened and self.open in body[:close_at]:
            # Text, then a block: the model answered before it reasoned. Not a reasoning block the
            # template would render, so the whole reply stays content for the format to judge.
            return None, text
        return _clean(body[:close_at]), body[close_at + len(self.close) :]


THINK_TAGS = ReasoningTags("<think>", "</think>")


class ReplyFormat(abc.ABC):
    """One family's way of writing an assistant turn. Subclasses set the class attributes."""

    name: ClassVar[str]
    """Short identifier, e.g. ``"hermes-json"``."""
    families: ClassVar[str]
    """The model families that write this form, for messages and the README's table."""
    extra_stops: ClassVar[tuple[str, ...]] = ()
    """Tokens besides the template's turn closing that end a reply (gpt-oss's ``<|call|>``)."""
    stops_open_next_turn: ClassVar[bool] = False
    """True when the stop tokens are the next turn's opening (GLM's ``<|observation|>``): the
    sampled stop token then stands for the first token of what the template writes next."""
    max_calls: ClassVar[int | None] = None
    """How many tool calls one turn may hold (None: any number); more is a parse failure, since
    the template could not render the reply."""
    reasoning_tags: ReasoningTags | None = None
    """The markup of the reasoning block this format reads, if it reads one by tags."""

    @property
    def has_reasoning(self) -> bool:
        """Whether replies in this format can hold reasoning that goes to ``reasoning_content``."""
        return self.reasoning_tags is not None

    @classmethod
    @abc.abstractmethod
    def writes(cls, rendered_call: str) -> bool:
        """Whether ``rendered_call``, a template's rendering of an assistant turn holding one call
        of ``lookup(key="probe-value")``, is written in this format."""

    @abc.abstractmethod
    def parse(self, text: str, tool_specs: Sequence[ToolSpec], *, in_reasoning: bool = False) -> ParsedReply:
        """Read ``text`` (the decoded reply, final stop token left out).

        ``in_reasoning``: the generation prompt opened a reasoning block, so the reply starts
        inside it. Raises :class:`ToolCallFormatError` only.
        """

    def stop_after(self, has_calls: bool) -> str | None:
        """For formats whose stops open the next turn: the stop a model samples after a reply."""
        return None


def check_reply_length(text: str) -> None:
    if len(text) > MAX_REPLY_CHARS:
        raise ToolCallFormatError(
            f"the reply is {len(text)} characters long; at most {MAX_REPLY_CHARS} are parsed (a runaway "
            "reply: lower max_tokens_per_turn if replies this long are expected to be cut)"
        )


def _clean(reasoning: str) -> str:
    return reasoning.strip()


def tool_parameters(tool_specs: Sequence[ToolSpec]) -> dict[str, Mapping[str, Any]]:
    """Each tool's ``properties`` schema by tool name (empty when a spec has none)."""
    found: dict[str, Mapping[str, Any]] = {}
    for spec in tool_specs:
        function = spec.get("function", {}) if isinstance(spec, Mapping) else {}
        parameters = function.get("parameters") if isinstance(function, Mapping) else None
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            found[name] = properties if isinstance(properties, Mapping) else {}
    return found


def schema_types(schema: object) -> set[str]:
    """The JSON types a parameter schema admits (``type``, a list of types, ``anyOf``/``oneOf``)."""
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or () if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for choice in schema.get(key) or ():
            types |= schema_types(choice)
    if schema.get("enum") and not types:
        types = {_json_type_name(value) for value in schema["enum"]}
    return types


def typed_value(raw: str, schema: object) -> Any:
    """A parameter value written as text (Qwen3.5+'s ``<parameter=...>``, GLM's ``<arg_value>``)
    read back as the template wrote it: strings verbatim, anything else as JSON.

    The tool's schema decides which: a string parameter keeps the text; any other type is read as
    JSON, and text that is not JSON of an admitted type stays a string, so the tool's own argument
    check reports the wrong type to the model as a ``tool_error``, as for a JSON-format call. A
    parameter the schema does not describe is JSON when it reads as a non-string JSON value.
    """
    types = schema_types(schema)
    if types == {"string"}:
        return raw
    try:
        value = loads_plain_json(raw)
    except (json.JSONDecodeError, PlainJSONError):
        return raw
    if isinstance(value, str):
        return raw
    if (
        not types
        or _json_type_name(value) in types
        or ("number" in types and _json_type_name(value) == "integer")
    ):
        return value
    return raw


def _json_type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def json_type(value: object) -> str:
    """``value``'s JSON type in words, for error messages."""
    names = {"null": "JSON null", "boolean": "a JSON boolean", "integer": "a JSON number",
             "number": "a JSON number", "string": "a JSON string", "array": "a JSON array",
             "object": "a JSON object"}  # fmt: skip
    if isinstance(value, (dict, list, str, int, float, bool)) or value is None:
        return names[_json_type_name(value)]
    return type(value).__name__


def split_blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], list[str]]:
    """``(pieces, bodies)``: the text outside ``open_tag ... close_tag`` blocks, and each block's
    body, in order. Raises :class:`ToolCallFormatError` for a closing tag with no opening one
    before it, a block that is never closed, and one not closed before the next opens. Linear in
    ``text``: each position is scanned a bounded number of times."""
    pieces: list[str] = []
    bodies: list[str] = []
    position = 0
    while True:
        open_at = text.find(open_tag, position)
        close_at = text.find(close_tag, position)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            raise ToolCallFormatError(
                f"stray {close_tag} at character {close_at} with no {open_tag} before it"
            )
        if open_at == -1:
            pieces.append(text[position:])
            return pieces, bodies
        pieces.append(text[position:open_at])
        body_start = open_at + len(open_tag)
        close_at = text.find(close_tag, body_start)
        if close_at == -1:
            raise ToolCallFormatError(
                f"unclosed {open_tag} at character {open_at}: no {close_tag} follows it"
            )
        body = text[body_start:close_at]
        if open_tag in body:
            raise ToolCallFormatError(
                f"{open_tag} at character {open_at} is not closed before the next {open_tag}"
            )
        bodies.append(body)
        position = close_at + len(close_tag)


def read_json(text: str, what: str) -> Any:
    """``text`` as one plain JSON value (:func:`~cookbook_lib.plain_json.loads_plain_json`); malformed
    or non-plain JSON raises :class:`ToolCallFormatError` naming ``what`` and where it broke."""
    try:
        return loads_plain_json(text)
    except json.JSONDecodeError as exc:
        snippet = text.strip()[:200]
        raise ToolCallFormatError(
            f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): {snippet!r}"
        ) from None
    except PlainJSONError as exc:
        raise ToolCallFormatError(f"{what} is not plain JSON: {exc}") from None


def nonblank_name(name: object, where: str) -> str:
    """A call's ``"name"`` value: any non-blank string (the templates writing JSON calls ask no more)."""
    if not isinstance(name, str) or not name.strip():
        got = "a blank string" if isinstance(name, str) else json_type(name)
        raise ToolCallFormatError(f'{where}: "name" must be a non-empty string, got {got}')
    return name


def read_call_object(
    payload: object,
    where: str,
    *,
    arguments_key: str = "arguments",
    extra_keys: Collection[str] = (),
    name_rule: Callable[[object, str], str] = nonblank_name,
) -> tuple[str, dict[str, Any]]:
    """A tool call written as one JSON object, ``{"name": ..., "<arguments_key>": {...}}`` (plus
    the optional ``extra_keys``): its ``(name, arguments)``, the name checked by ``name_rule``;
    anything else raises :class:`ToolCallFormatError` saying what is wrong in ``where``."""
    if not isinstance(payload, dict):
        shape = f'{{"name": ..., "{arguments_key}": {{...}}}}'
        raise ToolCallFormatError(f"{where} must be a JSON object {shape}, got {json_type(payload)}")
    allowed = {"name", arguments_key, *extra_keys}
    unexpected = sorted(set(payload) - allowed)
    if unexpected:
        expected = ", ".join(f'"{key}"' for key in sorted(allowed))
        raise ToolCallFormatError(f"{where} has unexpected keys {unexpected}; expected {expected}")
    if "name" not in payload:
        raise ToolCallFormatError(f'{where} has no "name"')
    name = name_rule(payload["name"], where)
    if arguments_key not in payload:
        raise ToolCallFormatError(f'{where} ({name}) has no "{arguments_key}" (use {{}} for none)')
    arguments = payload[arguments_key]
    if not isinstance(arguments, dict):
        raise ToolCallFormatError(
            f'{where} ({name}): "{arguments_key}" must be a JSON object, got {json_type(arguments)}'
        )
    return name, arguments


def join_content(pieces: Sequence[str]) -> str:
    """Text outside the markup: each piece stripped, the non-empty ones joined by newlines."""
    return "\n".join(piece.strip() for piece in pieces if piece.strip())


def check_name(name: str, where: str) -> str:
    """A tool name as a model wrote it: non-empty, no whitespace or markup inside."""
    if not name or any(ch.isspace() for ch in name) or any(ch in name for ch in "<>{}()[]\"'"):
        raise ToolCallFormatError(f"{where}: {name[:80]!r} is not a tool name")
    return name


def check_call_count(calls: Sequence[ToolCallTuple], max_calls: int | None, families: str) -> None:
    if max_calls is not None and len(calls) > max_calls:
        raise ToolCallFormatError(
            f"the reply makes {len(calls)} tool calls; the {families} template renders at most "
            f"{max_calls} per turn"
        )
