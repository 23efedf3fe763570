"""MistralCodec on the tokenizers mistral-common ships, loaded as transformers loads a Mistral model's.

mistral-common's wheel holds real Mistral tokenizers (``mistral_common/data/``): sentencepiece v3
(Mistral 7B v0.3), tekken v3 (Nemo; and Pixtral's), sentencepiece v7 (Large 2411). No v11 or v13
file ships, so those are built from tekken_240718's vocabulary with the version and the special
tokens those versions add ([ARGS], [CALL_ID], and [THINK]/[/THINK] for a Magistral-like one):
the ids differ from a real v13 tokenizer's, but the rendering is mistral-common's own v11/v13 code.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cookbook_lib.codecs.base import ParseResult, UnsupportedChatTemplateError
from cookbook_lib.codecs.check import SPECS, check_codec
from cookbook_lib.codecs.mistral import (
    MistralCodec,
    MistralFormat,
    is_mistral_common_tokenizer,
    mistral_call_id,
)
from cookbook_lib.codecs.reply import MAX_REPLY_CHARS, ToolCallFormatError
from cookbook_lib.types import Message, make_tool_call

# (cookbook_lib.codecs.mistral imports mistral-common only when a codec is built.)
mistral_common = pytest.importorskip("mistral_common", reason="pip install -e '.[mistral]'")
DATA = Path(str(mistral_common.__file__)).parent / "data"
# name -> (file in mistral_common/data, the name transformers loads it by)
SHIPPED = {
    "v3-spm": ("mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3"),
    "v3-tekken": ("tekken_240718.json", "tekken.json"),
    "v3-tekken-pixtral": ("tekken_240911.json", "tekken.json"),
    "v7-spm": ("mistral_instruct_tokenizer_241114.model.v7", "tokenizer.model.v7"),
}
# name -> (the version written into a copy of tekken_240718.json, whether it gets [THINK] tokens)
SYNTHETIC = {"v11-tekken": ("v11", False), "v13-tekken": ("v13", False), "v13-tekken-think": ("v13", True)}
ALL = [*SHIPPED, *SYNTHETIC]
JSON_STYLE = ["v3-spm", "v3-tekken", "v7-spm"]
ARGS_STYLE = list(SYNTHETIC)
# mistral-common's default special tokens (ranks 0 to 19, as in every tekken file), fillers, then
# the ones v11+ add, at ranks chosen here (a real file's ids may differ; nothing depends on them).
_BASE_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                  "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                  "[TOOL_CONTENT]"]  # fmt: skip
_ID = re.compile(r"[a-zA-Z0-9]{9}")


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], MistralCodec]]:
    """``load(name)``: the codec for one tokenizer, loaded once per module."""
    from transformers.tokenization_mistral_common import MistralCommonBackend

    codecs: dict[str, MistralCodec] = {}
    tekken: dict[str, Any] = {}

    def folder(name: str) -> Path:
        path = tmp_path_factory.mktemp(name)
        if name in SHIPPED:
            source, target = SHIPPED[name]
            shutil.copy(DATA / source, path / target)
            return path
        version, think = SYNTHETIC[name]
        if not tekken:
            tekken.update(json.loads((DATA / "tekken_240718.json").read_text(encoding="utf-8")))
        names = [*_BASE_SPECIALS, *(f"<SPECIAL_{rank}>" for rank in range(20, 32)), "[ARGS]", "[CALL_ID]"]
        names += ["[THINK]", "[/THINK]"] if think else []
        data = {**tekken, "config": {**tekken["config"], "version": version}}
        data["special_tokens"] = [
            {"rank": rank, "token_str": s, "is_control": True} for rank, s in enumerate(names)
        ]
        (path / "tekken.json").write_text(json.dumps(data), encoding="utf-8")
        return path

    def get(name: str) -> MistralCodec:
        if name not in codecs:
            codecs[name] = MistralCodec(MistralCommonBackend.from_pretrained(str(folder(name))))
        return codecs[name]

    yield get


@pytest.fixture(scope="module", params=ALL)
def codec(request: pytest.FixtureRequest, load: Callable[[str], MistralCodec]) -> MistralCodec:
    return load(request.param)


@pytest.fixture(scope="module", params=JSON_STYLE)
def json_codec(request: pytest.FixtureRequest, load: Callable[[str], MistralCodec]) -> MistralCodec:
    return load(request.param)


@pytest.fixture(scope="module", params=ARGS_STYLE)
def args_codec(request: pytest.FixtureRequest, load: Callable[[str], MistralCodec]) -> MistralCodec:
    return load(request.param)


def tokens(codec: MistralCodec, *parts: str | int) -> list[int]:
    """Token ids as a model samples them: a special token's name is that token, an int an id, any
    other string its text tokens (as mistral-common encodes message text)."""
    raw = codec._raw
    out: list[int] = []
    for part in parts:
        if isinstance(part, int):
            out.append(part)
        elif raw.is_special(part):
            out.append(int(raw.get_special_token(part)))
        else:
            out += [int(token) for token in raw.encode(part, bos=False, eos=False)]
    return out


def reply(content: str, *calls: tuple[str, dict[str, Any]], reasoning: str | None = None) -> Message:
    message = Message(role="assistant", content=content)
    if calls:
        message["tool_calls"] = [make_tool_call(call_id, "lookup", args) for call_id, args in calls]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def calls_of(message: Message) -> list[tuple[str, str, Any]]:
    return [
        (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in message.get("tool_calls", [])
    ]


def writes_ids(codec: MistralCodec) -> bool:
    return codec.version <= 11


# -- the template self-check and what the codec says about itself ----------------------------------


def test_self_check_passes(codec: MistralCodec) -> None:
    report = check_codec(codec)
    assert report.failed == [], report.lines()
    assert report.restarts == 0
    statuses = {probe.name: probe.status for probe in report.probes}
    assert statuses["reasoning"] == ("ok" if codec.reply_format.has_reasoning else "skipped")
    assert all(status == "ok" for name, status in statuses.items() if name != "reasoning")


def test_codec_properties(codec: MistralCodec) -> None:
    assert is_mistral_common_tokenizer(codec.tokenizer)
    assert codec.tokenizer.chat_template is None
    assert codec.stop_token_ids == [codec.tokenizer.eos_token_id] == [codec.end_of_turn_id]
    assert codec.close_turn(tokens(codec, "</s>")) == []
    assert codec.close_turn(tokens(codec, "cut off")) == [codec.end_of_turn_id]
    assert codec.reply_format.has_reasoning == (codec.version >= 13 and codec._raw.is_special("[THINK]"))
    assert not codec.prompt_opens_reasoning


def test_refuses_v2_and_other_tokenizers(tmp_path: Path) -> None:
    from transformers.tokenization_mistral_common import MistralCommonBackend

    shutil.copy(DATA / "mistral_instruct_tokenizer_240216.model.v2", tmp_path / "tokenizer.model.v2")
    with pytest.raises(UnsupportedChatTemplateError, match="v2"):
        MistralCodec(MistralCommonBackend.from_pretrained(str(tmp_path)))
    with pytest.raises(UnsupportedChatTemplateError, match="MistralCommonBackend"):
        MistralCodec(object())  # type: ignore[arg-type]
    assert not is_mistral_common_tokenizer(object())


# -- round trips --------------------------------------------------------------------------------


def test_round_trip_one_call(codec: MistralCodec) -> None:
    message = reply("", ("Ab3dE5gH7", {"key": "alpha", "count": 3}))
    sampled = codec.render_assistant(message)
    assert sampled[-1] == codec.end_of_turn_id
    parsed = codec.parse(sampled, SPECS)
    assert parsed.message is not None, parsed.error
    assert parsed.message["content"] == ""
    [(call_id, name, arguments)] = calls_of(parsed.message)
    assert (name, arguments) == ("lookup", {"key": "alpha", "count": 3})
    # The model's own id is kept where the tokenizer renders ids, so the history renders as sampled.
    assert call_id == "Ab3dE5gH7" if writes_ids(codec) else _ID.fullmatch(call_id)
    if codec.version <= 7:
        expected = (
            '[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "alpha", "count": 3}, "id": "Ab3dE5gH7"}]'
        )
    elif codec.version == 11:
        expected = '[TOOL_CALLS]lookup[CALL_ID]Ab3dE5gH7[ARGS]{"key": "alpha", "count": 3}'
    else:
        expected = '[TOOL_CALLS]lookup[ARGS]{"key": "alpha", "count": 3}'
    assert parsed.text == expected  # real text, also for sentencepiece (no "▁" pieces)


def test_round_trip_parallel_calls(codec: MistralCodec) -> None:
    message = reply("", ("Ab3dE5gH7", {"key": "alpha"}), ("Zz9yY8xX7", {"key": "beta", "count": 2}))
    parsed = codec.parse(codec.render_assistant(message), SPECS)
    assert parsed.message is not None, parsed.error
    found = calls_of(parsed.message)
    assert [(name, args) for _, name, args in found] == [
        ("lookup", {"key": "alpha"}),
        ("lookup", {"key": "beta", "count": 2}),
    ]
    ids = [call_id for call_id, _, _ in found]
    assert ids == ["Ab3dE5gH7", "Zz9yY8xX7"] if writes_ids(codec) else len(set(ids)) == 2


def test_round_trip_plain_answer(codec: MistralCodec) -> None:
    answer = "The value is 17.\nIt came from the tool (ünïcödé, 😀, tabs\tand  spaces)."
    parsed = codec.parse(codec.render_assistant(reply(answer)), SPECS)
    assert parsed.message == Message(role="assistant", content=answer)
    assert parsed.text == answer


def test_content_with_calls(codec: MistralCodec) -> None:
    message = reply("Let me look that up.", ("Ab3dE5gH7", {"key": "alpha"}))
    if codec.version < 7:
        # v3 renders a turn with text or calls, not both: mistral-common refuses, and so does the parser.
        with pytest.raises(ValueError, match="mistral-common cannot render"):
            codec.render_assistant(message)
        sampled = tokens(
            codec, "Let me look.", "[TOOL_CALLS]", '[{"name": "lookup", "arguments": {}}]', "</s>"
        )
        result = codec.parse(sampled, SPECS)
        assert result.message is None and "either text or tool calls" in (result.error or "")
        return
    parsed = codec.parse(codec.render_assistant(message), SPECS)
    assert parsed.message is not None, parsed.error
    assert parsed.message["content"] == "Let me look that up."
    assert [(name, args) for _, name, args in calls_of(parsed.message)] == [("lookup", {"key": "alpha"})]


def test_reasoning_round_trip(load: Callable[[str], MistralCodec]) -> None:
    codec = load("v13-tekken-think")
    message = reply("Looking it up.", ("Ab3dE5gH7", {"key": "alpha"}), reasoning="I need alpha first.")
    sampled = codec.render_assistant(message)
    parsed = codec.parse(sampled, SPECS)
    assert (
        parsed.text
        == '[THINK]I need alpha first.[/THINK]Looking it up.[TOOL_CALLS]lookup[ARGS]{"key": "alpha"}'
    )
    assert parsed.message is not None, parsed.error
    assert parsed.message["reasoning_content"] == "I need alpha first."
    assert parsed.message["content"] == "Looking it up."
    # Without [THINK] tokens a reasoning field is not rendered (as templates ignore it).
    plain = load("v13-tekken")
    assert plain.render_assistant(message) == plain.render_assistant(
        reply("Looking it up.", ("Ab3dE5gH7", {"key": "alpha"}))
    )


# -- multi-turn, token by token -----------------------------------------------------------------


def test_episode_built_token_by_token_equals_fresh_render(codec: MistralCodec) -> None:
    messages = [
        Message(role="system", content="Answer with the tool's help."),
        Message(role="user", content="Alpha?"),
    ]
    prompt = codec.render_prompt(messages, SPECS)
    restarts = []
    turns: list[tuple[Message, list[Message]]] = [
        (reply("", ("Ab3dE5gH7", {"key": "alpha"}), ("Zz9yY8xX7", {"key": "beta"})), []),
        (reply("Alpha is 17, beta 25."), [Message(role="user", content="And gamma?")]),
        (reply("", ("Gg7hH6jJ5", {"key": "gamma"})), []),
    ]
    for expert, after in turns:
        sampled = codec.render_assistant(expert)
        parsed = codec.parse(sampled, SPECS)
        assert parsed.message is not None, parsed.error
        messages.append(parsed.message)
        new = after or [
            Message(role="tool", content=f"result-{i}", name="lookup", tool_call_id=call["id"])
            for i, call in enumerate(parsed.message["tool_calls"])
        ]
        continuation = codec.render_continuation(messages, sampled, new, SPECS)
        messages += new
        fresh = codec.render_prompt(messages, SPECS)
        restarts.append(continuation.restarted)
        if continuation.restarted:
            assert continuation.tokens == fresh
            prompt = continuation.tokens
        else:
            prompt = prompt + sampled + codec.close_turn(sampled) + continuation.tokens
            assert prompt == fresh  # token for token, not only as text
    # Tool results never rewrite history. A new user message does up to v11, where the tools block
    # (and v3's system prompt) stands before the last user message; from v13 before the first.
    assert restarts == [False, codec.version <= 11, False]


def test_call_without_id_gets_a_fresh_valid_id(codec: MistralCodec) -> None:
    if codec.version <= 7:
        sampled = tokens(codec, "[TOOL_CALLS]", '[{"name": "lookup", "arguments": {"key": "a"}}]', "</s>")
    else:
        sampled = tokens(codec, "[TOOL_CALLS]", "lookup", "[ARGS]", '{"key": "a"}', "</s>")
    messages = [Message(role="user", content="Alpha?")]
    parsed = codec.parse(sampled, SPECS)
    assert parsed.message is not None, parsed.error
    [(call_id, _, _)] = calls_of(parsed.message)
    assert _ID.fullmatch(call_id)
    messages.append(parsed.message)
    new = [Message(role="tool", content="17", name="lookup", tool_call_id=call_id)]
    continuation = codec.render_continuation(messages, sampled, new, SPECS)
    # The model's tokens stay as sampled; the tool result after them is mistral-common's own.
    assert not continuation.restarted
    assert codec.render_prompt([*messages, *new], SPECS)[-len(continuation.tokens) :] == continuation.tokens


def test_fresh_ids_are_seeded_and_distinct(load: Callable[[str], MistralCodec]) -> None:
    base = load("v13-tekken")
    first, second = MistralCodec(base.tokenizer, call_id_seed=7), MistralCodec(base.tokenizer, call_id_seed=7)
    sampled = tokens(
        base, "[TOOL_CALLS]", "lookup", "[ARGS]", "{}", "[TOOL_CALLS]", "lookup", "[ARGS]", "{}", "</s>"
    )
    one, two = first.parse(sampled), second.parse(sampled)
    assert one.message is not None and two.message is not None
    assert calls_of(one.message) == calls_of(two.message)
    ids = [call_id for call_id, _, _ in calls_of(one.message)]
    assert len(set(ids)) == 2 and all(_ID.fullmatch(call_id) for call_id in ids)


def test_foreign_call_ids_render_as_digests(codec: MistralCodec) -> None:
    assert mistral_call_id("Ab3dE5gH7") == "Ab3dE5gH7"
    digest = mistral_call_id("call_0")
    assert _ID.fullmatch(digest) and digest == mistral_call_id("call_0") != mistral_call_id("call_1")
    messages = [
        Message(role="user", content="Alpha?"),
        reply("", ("call_0", {"key": "alpha"})),
        Message(role="tool", content="17", name="lookup", tool_call_id="call_0"),
    ]
    text = codec.decode_text(codec.render_prompt(messages, SPECS))
    assert (digest in text) == writes_ids(codec) and "call_0" not in text


def test_prompt_must_not_end_with_an_assistant_turn(codec: MistralCodec) -> None:
    with pytest.raises(ValueError, match="assistant"):
        codec.render_prompt([Message(role="user", content="hi"), reply("hello")], [])
    with pytest.raises(ValueError, match="empty"):
        codec.render_prompt([], [])


# -- parse failures -----------------------------------------------------------------------------

DEEP = "[" * 100 + "]" * 100
JSON_FAILURES: dict[str, tuple[str, str]] = {
    "unclosed JSON": ('[{"name": "lookup", "arguments": {"key": "a"}', "not valid JSON"),
    "invalid JSON": ("[{name: lookup}]", "not valid JSON"),
    "nothing after the marker": ("", "not valid JSON"),
    "an object, not a list": ('{"name": "lookup", "arguments": {}}', "JSON list"),
    "a string, not a list": ('"lookup"', "JSON list"),
    "an empty list": ("[]", "empty list"),
    "an item that is no object": ('["lookup"]', "must be a JSON object"),
    "parameters, not arguments": ('[{"name": "lookup", "parameters": {}}]', "unexpected keys"),
    "an extra key": ('[{"name": "lookup", "arguments": {}, "type": "function"}]', "unexpected keys"),
    "no name": ('[{"arguments": {}}]', 'no "name"'),
    "no arguments": ('[{"name": "lookup"}]', 'no "arguments"'),
    "a name that is no string": ('[{"name": 7, "arguments": {}}]', "must be a string"),
    "a name with a space": ('[{"name": "look up", "arguments": {}}]', "not a tool name"),
    "arguments as a JSON string": (
        '[{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}]',
        "JSON object",
    ),
    "arguments as a list": ('[{"name": "lookup", "arguments": ["a"]}]', "JSON object"),
    "a bad call id": ('[{"name": "lookup", "arguments": {}, "id": "call_1"}]', "9 letters or digits"),
    "a call id that is no string": (
        '[{"name": "lookup", "arguments": {}, "id": 123456789}]',
        "9 letters or digits",
    ),
    "two calls with one id": (
        json.dumps([{"name": "lookup", "arguments": {}, "id": "Ab3dE5gH7"}] * 2),
        "same id",
    ),
    "text after the list": ('[{"name": "lookup", "arguments": {}}] and then some', "text after"),
    "NaN": ('[{"name": "lookup", "arguments": {"x": NaN}}]', "not plain JSON"),
    "a 400-digit number": ('[{"name": "lookup", "arguments": {"x": ' + "9" * 400 + "}}]", "not plain JSON"),
    "deep nesting": ('[{"name": "lookup", "arguments": {"x": ' + DEEP + "}}]", "nested more than"),
}
ARGS_FAILURES: dict[str, tuple[list[str], str]] = {
    "no [ARGS]": (["[TOOL_CALLS]", 'lookup{"key": "a"}'], "no [ARGS]"),
    "[ARGS] only after the next call": (
        ["[TOOL_CALLS]", "lookup", "[TOOL_CALLS]", "lookup", "[ARGS]", "{}"],
        "no [ARGS]",
    ),
    "nothing after the marker": (["[TOOL_CALLS]"], "no [ARGS]"),
    "unclosed JSON": (["[TOOL_CALLS]", "lookup", "[ARGS]", '{"key": "a"'], "not valid JSON"),
    "no JSON": (["[TOOL_CALLS]", "lookup", "[ARGS]"], "not valid JSON"),
    "arguments as a list": (["[TOOL_CALLS]", "lookup", "[ARGS]", "[1, 2]"], "JSON object"),
    "arguments as a string": (["[TOOL_CALLS]", "lookup", "[ARGS]", '"key"'], "JSON object"),
    "no name": (["[TOOL_CALLS]", "[ARGS]", "{}"], "not a tool name"),
    "a name with a space": (["[TOOL_CALLS]", "look up", "[ARGS]", "{}"], "not a tool name"),
    "markup for a name": (["[TOOL_CALLS]", "[INST]", "[ARGS]", "{}"], "not a tool name"),
    "text after the arguments": (
        ["[TOOL_CALLS]", "lookup", "[ARGS]", '{"key": "a"} and then some'],
        "text after",
    ),
    "a stray [ARGS]": (["Sure", "[ARGS]", "{}"], "stray [ARGS]"),
    "NaN": (["[TOOL_CALLS]", "lookup", "[ARGS]", '{"x": NaN}'], "not plain JSON"),
    "deep nesting": (["[TOOL_CALLS]", "lookup", "[ARGS]", '{"x": ' + DEEP + "}"], "nested more than"),
}


@pytest.mark.parametrize("case", list(JSON_FAILURES))
def test_malformed_json_list_replies_fail(json_codec: MistralCodec, case: str) -> None:
    body, reason = JSON_FAILURES[case]
    result = json_codec.parse(tokens(json_codec, "[TOOL_CALLS]", body, "</s>"), SPECS)
    assert result.message is None and reason in (result.error or ""), result
    assert result.text.startswith("[TOOL_CALLS]")


@pytest.mark.parametrize("case", list(ARGS_FAILURES))
def test_malformed_args_replies_fail(args_codec: MistralCodec, case: str) -> None:
    parts, reason = ARGS_FAILURES[case]
    result = args_codec.parse(tokens(args_codec, *parts, "</s>"), SPECS)
    assert result.message is None and reason in (result.error or ""), result


def test_call_ids_in_the_args_form(load: Callable[[str], MistralCodec]) -> None:
    v11, v13 = load("v11-tekken"), load("v13-tekken")
    bad = v11.parse(tokens(v11, "[TOOL_CALLS]", "lookup", "[CALL_ID]", "abc", "[ARGS]", "{}", "</s>"))
    assert bad.message is None and "9 letters or digits" in (bad.error or "")
    twice = ["[TOOL_CALLS]", "lookup", "[CALL_ID]", "Ab3dE5gH7", "[ARGS]", "{}"] * 2
    same = v11.parse(tokens(v11, *twice, "</s>"))
    assert same.message is None and "same id" in (same.error or "")
    written = v13.parse(
        tokens(v13, "[TOOL_CALLS]", "lookup", "[CALL_ID]", "Ab3dE5gH7", "[ARGS]", "{}", "</s>")
    )
    assert written.message is None and "writes no call ids" in (written.error or "")


def test_marker_text_inside_json_strings(load: Callable[[str], MistralCodec]) -> None:
    # The arguments' end is found by reading the JSON, not by searching for the next marker.
    codec = load("v13-tekken")
    arguments = {"key": "[TOOL_CALLS]x[ARGS]{}", "count": 1}
    sampled = tokens(
        codec,
        "[TOOL_CALLS]",
        "lookup",
        "[ARGS]",
        json.dumps(arguments),
        "[TOOL_CALLS]",
        "lookup",
        "[ARGS]",
        "{}",
        "</s>",
    )
    parsed = codec.parse(sampled, SPECS)
    assert parsed.message is not None, parsed.error
    assert [args for _, _, args in calls_of(parsed.message)] == [arguments, {}]


def test_v3_content_before_calls_fails_in_the_format() -> None:
    with pytest.raises(ToolCallFormatError, match="either text or tool calls"):
        MistralFormat(content_with_calls=False).parse(
            'Sure.[TOOL_CALLS][{"name": "lookup", "arguments": {}}]', []
        )


def test_degenerate_token_ids_fail(codec: MistralCodec) -> None:
    for ids in ([-1], [codec._vocab_size], [10**12], [5, -3, 7]):
        result = codec.parse(ids, SPECS)
        assert result.message is None and "cannot be decoded" in (result.error or "")
    empty = codec.parse(tokens(codec, "</s>"), SPECS)
    assert empty.message is None and "cannot render this reply" in (empty.error or "")


def test_runaway_reply_is_refused_unscanned(load: Callable[[str], MistralCodec]) -> None:
    codec = load("v3-spm")
    result = codec.parse(tokens(codec, "[TOOL_CALLS]", "[" + "1," * (MAX_REPLY_CHARS // 2) + "1]"))
    assert result.message is None and "characters long" in (result.error or "")


# -- hostile input ------------------------------------------------------------------------------

MARKUP = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "</s>", "<s>", "[INST]",
          "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CONTENT]", "[AVAILABLE_TOOLS]",
          "[SYSTEM_PROMPT]"]  # fmt: skip
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
# The same without NaN and infinities, and with integers of at most 19 digits: what a tool call may carry.
PLAIN_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**18), 10**18)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
CALL_DICTS = st.fixed_dictionaries(
    {"name": st.sampled_from(["lookup", "look up", "", "x" * 70]), "arguments": JSON_VALUES},
    optional={"id": st.sampled_from(["Ab3dE5gH7", "short", 7]), "extra": JSON_VALUES},
)
PARTS = st.one_of(
    st.sampled_from(MARKUP),  # the special token, where the tokenizer has it
    st.sampled_from(MARKUP).map(lambda marker: " " + marker),  # the same characters as plain text
    st.sampled_from(["lookup", "{", "}", "[", "]", '"', ",", ":", " ", "\n", "NaN", "-Infinity", "1e999"]),
    JSON_VALUES.map(lambda value: json.dumps(value)),
    st.lists(CALL_DICTS, max_size=3).map(json.dumps),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "{" * (depth % 7)),
    st.integers(300, 5000).map(lambda digits: "9" * digits),
    st.integers(1000, 50_000).map(lambda count: json.dumps(list(range(count)))),  # up to ~300k characters
    st.text(max_size=40),
    st.integers(0, 131_071),  # any token id (taken modulo the vocabulary size)
)


def _hostile_tokens(codec: MistralCodec, parts: list[str | int]) -> list[int]:
    return tokens(codec, *(part % codec._vocab_size if isinstance(part, int) else part for part in parts))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(PARTS, max_size=10), call=st.booleans(), stop=st.booleans())
def test_hostile_replies_never_raise(
    codec: MistralCodec, parts: list[str | int], call: bool, stop: bool
) -> None:
    # Half the replies open with the call marker, so the call parser sees most of the hostile text.
    sampled = _hostile_tokens(codec, ["[TOOL_CALLS]", *parts] if call else parts)
    sampled += tokens(codec, "</s>") if stop else []
    result = codec.parse(sampled, SPECS)
    event("refused" if result.message is None else "calls" if result.message.get("tool_calls") else "answer")
    assert isinstance(result, ParseResult)
    assert (result.message is None) == (result.error is not None)
    # The format raised only its own error: no reply reached the parser's-bug branch.
    assert not (result.error or "").startswith("the parser failed")
    if result.message is not None:
        for tool_call in result.message.get("tool_calls", []):
            assert _ID.fullmatch(tool_call["id"])
            assert isinstance(json.loads(tool_call["function"]["arguments"]), dict)


@settings(max_examples=60, deadline=None)
@given(
    arguments=st.dictionaries(
        st.text(max_size=10),
        PLAIN_JSON_VALUES,
        max_size=4,
    ),
    # Not the markup's own names: in text they read as the markup (a model samples the tokens).
    content=st.text(max_size=30).filter(lambda text: not any(marker in text for marker in MARKUP)),
)
def test_written_calls_round_trip(codec: MistralCodec, arguments: dict[str, Any], content: str) -> None:
    message = reply(content.strip() if codec.version >= 7 else "", ("Ab3dE5gH7", arguments))
    parsed = codec.parse(codec.render_assistant(message), SPECS)
    assert parsed.message is not None, parsed.error
    assert [(name, args) for _, name, args in calls_of(parsed.message)] == [("lookup", arguments)]
    assert parsed.message["content"] == message["content"]
