"""Model output is untrusted input: no reply, token sequence or tool argument makes the library raise.

Every sampled reply ends as a message or a parse failure; every tool call as a result or a
``tool_error:`` message; every final answer as a reward. Fast lane: the rules of plain JSON, a
corpus of degenerate replies (each with its expected outcome), hypothesis properties of the parser,
the tools and the scoring, and whole episodes played on the corpus. Slow lane: 10^5 replies (random
token ids of the real vocabulary, special tokens included, and mutations of the corpus) parsed with
zero exceptions, each within :data:`PARSE_TIME_LIMIT_S`.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Mapping, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cookbook_lib.codecs import Codec, ParseResult, make_codec
from cookbook_lib.codecs.hermes import split_reply
from cookbook_lib.codecs.reply import MAX_REPLY_CHARS, ToolCallFormatError
from cookbook_lib.envs import TOOL_ERROR_PREFIX, Task
from cookbook_lib.envs.scoring import numbers_match, parse_number
from cookbook_lib.generators import Generator, SampleResult, SamplingParams
from cookbook_lib.plain_json import (
    MAX_INTEGER_DIGITS,
    MAX_JSON_CHARS,
    MAX_JSON_DEPTH,
    PlainJSONError,
    loads_plain_json,
)
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.runtime.models import load_tokenizer
from cookbook_lib.types import Message, make_tool_call
from envs.math_env import MathEnv
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks

# Generous: a parse takes well under a millisecond, the longest corpus reply tens of milliseconds,
# and CI machines are shared. A parse that scanned its input more than linearly would blow it.
PARSE_TIME_LIMIT_S = 1.0
GAME_TASK = load_tool_use_game_tasks("val")[0]
MATH_TASK = Task(prompt="What is 6 * 7?", target=42)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()  # the embedded model's real tokenizer: its vocabulary, its special tokens


@pytest.fixture(scope="module")
def codec(tokenizer) -> Codec:
    return make_codec(tokenizer)


def call(arguments: str, name: str = "lookup") -> str:
    """A tool-call block whose arguments are the raw text given (valid JSON or not)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def nested(depth: int) -> str:
    """Arrays and objects alternating, ``depth`` levels deep, with brackets inside strings too."""
    value = '"[{"'
    for level in range(depth):
        value = f"[{value}]" if level % 2 else f'{{"k{{": {value}}}'
    return value


# (name, reply text, expected: None = parses, or a regex the parse error must match)
DEGENERATE_REPLIES: list[tuple[str, str, str | None]] = [
    ("brackets opened 600 deep", call('{"key": ' + "[" * 600), "not valid JSON|nested"),
    ("brackets opened 5000 deep", call('{"key": ' + "[" * 5000), "nested more than 64"),
    ("brackets nested 600 deep, closed", call('{"key": ' + "[" * 600 + "]" * 600 + "}"), "nested more than"),
    ("nesting at the limit", call(nested(MAX_JSON_DEPTH - 1)), None),
    ("nesting one past the limit", call(nested(MAX_JSON_DEPTH)), "nested more than"),
    ("a 5000-digit integer", call('{"key": ' + "9" * 5000 + "}"), "integer has 5000 digits"),
    ("a 301-digit negative integer", call('{"key": -' + "9" * 301 + "}"), "integer has 301 digits"),
    ("a 300-digit integer", call('{"key": ' + "9" * MAX_INTEGER_DIGITS + "}"), None),
    ("a 10^4-digit fraction", call('{"key": 0.' + "3" * 10_000 + "}"), None),
    ("NaN", call('{"key": NaN}'), "NaN is not JSON"),
    ("Infinity", call('{"key": Infinity}'), "Infinity is not JSON"),
    ("-Infinity", call('{"key": [-Infinity]}'), "-Infinity is not JSON"),
    ("a float overflow", call('{"key": 1e999}'), "out of the range of a 64-bit float"),
    ("an unpaired high surrogate", call('{"key": "\\ud800"}'), "unpaired UTF-16 surrogate"),
    ("an unpaired low surrogate in a key", call('{"\\udfff": 1}'), "unpaired UTF-16 surrogate"),
    ("a reversed surrogate pair", call('{"key": "\\ude00\\ud83d"}'), "unpaired UTF-16 surrogate"),
    ("a surrogate pair", call('{"key": "\\ud83d\\ude00"}'), None),
    ("a raw newline in a JSON string", call('{"key": "a\nb"}'), "not valid JSON"),
    ("a raw NUL in a JSON string", call('{"key": "a\x00b"}'), "not valid JSON"),
    ("escaped control characters", call('{"key": "\\u0000\\u001b[31m\\b"}'), None),
    ("control characters in the content", "\x00\x07\x1b[31m 42 \x7f\x0c", None),
    ("a byte-order mark before the JSON", "<tool_call>\ufeff{}</tool_call>", "not valid JSON"),
    ("an invalid escape", call('{"key": "\\x41"}'), "not valid JSON"),
    ("special tokens mid-reply", "The answer<|im_start|>user\n42<|endoftext|> is<|im_end|> 42", None),
    ("special tokens in arguments", call('{"key": "<|im_end|><|im_start|>system"}'), None),
    ("special tokens inside the tags", "<tool_call><|im_start|></tool_call>", "not valid JSON"),
    ("a 100k-character argument", call('{"key": "' + "x" * 100_000 + '"}'), None),
    ("a 100k-character tool name", call("{}", name="n" * 100_000), None),
    ("a 10^5-element array", call('{"key": [' + "0," * 50_000 + "0]}"), None),
    ("a reply over the length limit", "7" * (MAX_REPLY_CHARS + 1), "characters long; at most"),
    ("a repetition loop", "I will look it up now. " * 3000, None),
    ("tool calls repeated 500 times", call('{"key": "a"}') * 500, None),
    ("unclosed tags repeated", "<tool_call>" * 500, "unclosed <tool_call>"),
    ("an unclosed tag", '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}', "unclosed <tool_call>"),
    ("stray closing tags", "</tool_call>" * 500, "stray </tool_call>"),
    ("endless brackets as content", "{[(" * 20_000, None),
    ("endless digits as content", "9" * 150_000, None),
    ("a tool call of only digits", "<tool_call>" + "9" * 5000 + "</tool_call>", "integer has 5000 digits"),
    ("JSON of only a string", '<tool_call>"' + "a" * 1000 + '"</tool_call>', "must be a JSON object"),
    ("duplicate keys", '<tool_call>{"name": "a", "name": "lookup", "arguments": {}}</tool_call>', None),
    ("replacement characters", "\ufffd" * 1000 + call('{"key": "\ufffd"}'), None),
]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def timed_parse(codec: Codec, tokens: Sequence[int]) -> tuple[ParseResult, float]:
    started = time.perf_counter()
    result = codec.parse(tokens)
    return result, time.perf_counter() - started


def assert_well_formed(result: ParseResult) -> None:
    """A message or an error, never both; what a message carries is plain, UTF-8-writable data."""
    assert isinstance(result.text, str)
    assert (result.message is None) == (result.error is not None) == (not result.ok)
    if result.message is None:
        assert isinstance(result.error, str) and result.error
        return
    assert result.message["role"] == "assistant" and isinstance(result.message["content"], str)
    result.message["content"].encode("utf-8")
    for tool_call in result.message.get("tool_calls", []):
        arguments = tool_call["function"]["arguments"]
        assert isinstance(loads_plain_json(arguments), dict)  # what tools receive: plain JSON
        arguments.encode("utf-8")


# --- plain JSON --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("NaN", "NaN is not JSON"),
        ('{"a": [Infinity]}', "Infinity is not JSON"),
        ("-Infinity", "-Infinity is not JSON"),
        ("1e400", "out of the range"),
        ("-1E+309", "out of the range"),
        ("1" * (MAX_INTEGER_DIGITS + 1), f"has {MAX_INTEGER_DIGITS + 1} digits"),
        (nested(MAX_JSON_DEPTH + 1), f"nested more than {MAX_JSON_DEPTH}"),
        ("[" * 3000 + "]" * 3000, f"nested more than {MAX_JSON_DEPTH}"),
        ('"\\ud800"', "unpaired"),
        ('["\ud800"]', "unpaired"),  # a literal surrogate character, not an escape
        (" " * (MAX_JSON_CHARS + 1), "characters long"),
    ],
)
def test_plain_json_refuses_what_is_not_a_plain_value_and_says_why(text, error):
    with pytest.raises(PlainJSONError, match=re.escape(error)):
        loads_plain_json(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1" * MAX_INTEGER_DIGITS, int("1" * MAX_INTEGER_DIGITS)),
        ("-1e308", -1e308),
        ('"\\ud83d\\ude00"', "\U0001f600"),
        ('"[[[[{{{{"', "[[[[{{{{"),
        ('{"a": [null, true, 1.5, "\\u0000"]}', {"a": [None, True, 1.5, "\x00"]}),
    ],
)
def test_plain_json_reads_plain_values(text, value):
    assert loads_plain_json(text) == value


def test_plain_json_nesting_limit_is_exact():
    assert loads_plain_json(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(PlainJSONError, match="nested"):
        loads_plain_json(nested(MAX_JSON_DEPTH + 1))


def test_malformed_json_is_still_a_decode_error():
    with pytest.raises(json.JSONDecodeError):
        loads_plain_json('{"a": ')


# --- the degenerate corpus ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "expected"), DEGENERATE_REPLIES, ids=[r[0] for r in DEGENERATE_REPLIES]
)
def test_degenerate_replies_parse_or_fail_cleanly(codec, tokenizer, name, text, expected):
    tokens = [*encode(tokenizer, text), codec.end_of_turn_id]
    result, elapsed = timed_parse(codec, tokens)
    assert_well_formed(result)
    if expected is None:
        assert result.ok, result.error
    else:
        assert result.error is not None and re.search(expected, result.error), result.error
        assert len(result.error) < 1000  # the reason is shown, not the whole reply
    assert elapsed < PARSE_TIME_LIMIT_S, f"{name}: {elapsed:.3f} s"


def test_token_ids_outside_the_vocabulary_are_a_parse_failure(codec, tokenizer):
    for tokens in ([-1], [2**40], [1, 2, -5]):
        result = codec.parse(tokens)
        assert not result.ok and "cannot be decoded" in result.error


class ReplayGenerator(Generator):
    """ "Samples" the given replies in order, as a backend would (respecting ``max_tokens``)."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        tokens = self.replies.pop(0)[: params.max_tokens] if self.replies else [0]
        stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
        return SampleResult(tokens, [-1.0] * len(tokens), "stop" if stopped else "length", [0] * len(tokens))

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        raise NotImplementedError

    @property
    def policy_version(self) -> int:
        return 0

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("tool_name", ["lookup", "calculator", "list_fact_keys", "no_such_tool"])
def test_episodes_on_the_corpus_end_without_errors(codec, tokenizer, tool_name):
    """The whole path: parse, the game's tools on degenerate arguments, the next prompt, scoring."""
    replies = []
    for _, text, _ in DEGENERATE_REPLIES:
        text = text.replace('"name": "lookup"', f'"name": "{tool_name}"').replace('"key"', '"expression"')
        replies.append([*encode(tokenizer, text), codec.end_of_turn_id])
    sampling = SamplingParams(max_tokens=10**6)

    async def play_all() -> list:
        episodes = []
        for reply in replies:
            policy = ModelPolicy(ReplayGenerator([reply, reply]), codec, sampling, max_model_length=10**6)
            episodes.append(await run_episode(ToolUseGameEnv(), GAME_TASK, policy, max_turns=2))
        return episodes

    for episode, (name, _, expected) in zip(asyncio.run(play_all()), DEGENERATE_REPLIES, strict=True):
        assert episode.end_cause is not EndCause.ERROR, f"{name}: {episode.error}"
        if expected is not None:
            assert episode.end_cause is EndCause.PARSE_FAILURE, name
        for message in episode.messages:
            if message["role"] == "tool" and message["content"].startswith(TOOL_ERROR_PREFIX):
                assert len(message["content"]) < 2000, f"{name}: a tool error echoes the whole input"


# --- properties --------------------------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    '{"name": "lookup", "arguments": ',
    '{"name": "calculator", "arguments": {"expression": ',
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    "\\",
    "\\u",
    "\\ud800",
    "NaN",
    "Infinity",
    "-",
    "1e999",
    "9" * 400,
    "0.5",
    "null",
    "true",
    "\n",
    "\x00",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "\ufffd",
]
degenerate_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=40).map(
    "".join
)
PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY_SETTINGS
@given(text=degenerate_text)
def test_parse_never_raises_on_degenerate_text(codec, tokenizer, text):
    result, elapsed = timed_parse(codec, encode(tokenizer, text))
    assert_well_formed(result)
    assert elapsed < PARSE_TIME_LIMIT_S


@PROPERTY_SETTINGS
@given(data=st.data())
def test_parse_never_raises_on_token_ids_from_the_vocabulary(codec, tokenizer, data):
    special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values()))
    token = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(special))
    result, elapsed = timed_parse(codec, data.draw(st.lists(token, max_size=200)))
    assert_well_formed(result)
    assert elapsed < PARSE_TIME_LIMIT_S


def json_values(leaf: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    )


def is_plain(value: object) -> bool:
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return len(str(abs(value))) <= MAX_INTEGER_DIGITS
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return all(is_plain(v) for v in value)
    return all(is_plain(k) and is_plain(v) for k, v in value.items())


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(),  # NaN and infinities included
    st.integers(),
    st.integers(min_value=-(10**320), max_value=10**320),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=8),  # lone surrogates too
)


@PROPERTY_SETTINGS
@given(value=json_values(json_leaf), ascii_only=st.booleans())
def test_arguments_parse_exactly_when_they_are_plain_json(value, ascii_only):
    """Any value Python's json writes (NaN, 400-digit ints, lone surrogates included) either comes
    back equal, when it is plain JSON, or is a parse failure saying why."""
    arguments = json.dumps({"v": value}, ensure_ascii=ascii_only)
    text = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    try:
        _, calls = split_reply(text)
    except ToolCallFormatError as exc:
        assert not is_plain(value), str(exc)
        assert "not plain JSON" in str(exc)
        return
    assert is_plain(value)
    assert json.dumps(calls[0][1]) == json.dumps({"v": value})  # equal, NaN-free, float for float


@PROPERTY_SETTINGS
@given(arguments=st.one_of(degenerate_text, json_values(json_leaf).map(lambda v: json.dumps({"key": v}))))
def test_game_tools_turn_any_arguments_into_a_result_or_a_tool_error(arguments):
    async def step(name: str) -> list[Message]:
        env = ToolUseGameEnv()
        await env.reset(GAME_TASK)
        message = Message(role="assistant", content="", tool_calls=[make_tool_call("c", name, arguments)])
        result = await env.step(message)
        return result.messages

    for name in ("lookup", "calculator", "list_fact_keys"):
        reply = asyncio.run(step(name))[-1]
        assert reply["role"] == "tool" and isinstance(reply["content"], str)
        if reply["content"].startswith(TOOL_ERROR_PREFIX):
            assert len(reply["content"]) < 2000


answers = st.one_of(
    degenerate_text,
    st.text(st.characters(codec=None, exclude_categories=())),
    st.text("0123456789.eE+- \t\n", max_size=400),
    st.sampled_from(["9" * 5000, "1e999", "nan", "-inf", "0x1p3", "١٢", "4_2", "1" * 100_000 + ".5"]),
)


@PROPERTY_SETTINGS
@given(answer=answers)
def test_scoring_any_final_answer_is_a_number_or_none_never_an_error(answer):
    value = parse_number(answer)
    assert value is None or (isinstance(value, float) and abs(value) != float("inf"))
    assert numbers_match(answer, 42) in (True, False)

    async def score(env) -> float:
        await env.reset(GAME_TASK if isinstance(env, ToolUseGameEnv) else MATH_TASK)
        return (await env.step(Message(role="assistant", content=answer))).reward

    assert asyncio.run(score(ToolUseGameEnv())) in (0.0, 1.0)
    assert asyncio.run(score(MathEnv())) in (0.0, 1.0)


# --- slow lane: 10^5 replies -------------------------------------------------------------------

NUM_FUZZ_REPLIES = 100_000
# Mostly structure-heavy tokens, so that random replies reach the JSON parser, not only plain text.
_INTERESTING_TEXT = [*FRAGMENTS, '"key"', '"expression"', "0", "1", "e", "E", "+", ".", " ", "\t", "\\n"]


def _fuzz_replies(codec: Codec, tokenizer, rng: random.Random):
    """Yield ``NUM_FUZZ_REPLIES`` token lists: uniform vocabulary ids (special tokens and bytes
    that decode to replacement characters included), the same inside a tool call's arguments, a
    mix biased to JSON and tag tokens, and the degenerate corpus mutated (cut, spliced, repeated,
    salted with random and special tokens)."""
    vocabulary = len(tokenizer)
    special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values()))
    interesting = sorted({t for text in _INTERESTING_TEXT for t in encode(tokenizer, text)} | set(special))
    prefix = encode(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"key": ')
    suffix = encode(tokenizer, "}}\n</tool_call>")
    corpus = [encode(tokenizer, text) for _, text, _ in DEGENERATE_REPLIES]
    short_corpus = [tokens for tokens in corpus if len(tokens) < 4000]
    stop = codec.end_of_turn_id

    def noise(length: int) -> list[int]:
        return [rng.randrange(vocabulary) for _ in range(length)]

    def structured(length: int) -> list[int]:
        return [
            rng.choice(interesting) if rng.random() < 0.7 else rng.randrange(vocabulary)
            for _ in range(length)
        ]

    def mutated() -> list[int]:
        # Long entries cost a decode each (tens of ms); most mutations use the shorter ones.
        tokens = list(rng.choice(corpus if rng.random() < 0.01 else short_corpus))
        for _ in range(rng.randint(1, 4)):
            if not tokens:
                break
            at = rng.randrange(len(tokens) + 1)
            kind = rng.randrange(5)
            if kind == 0:
                tokens = tokens[:at]
            elif kind == 1:
                tokens[at:at] = noise(rng.randint(1, 8))
            elif kind == 2:
                tokens[at:at] = [rng.choice(special)]
            elif kind == 3:
                end = min(len(tokens), at + rng.randint(1, 32))
                tokens[at:at] = tokens[at:end] * rng.randint(2, 20)
            else:
                del tokens[at : at + rng.randint(1, 16)]
        return tokens

    for index in range(NUM_FUZZ_REPLIES):
        kind = index % 4
        if kind == 0:
            tokens = noise(rng.randint(0, 128))
        elif kind == 1:
            tokens = [*prefix, *structured(rng.randint(0, 96)), *(suffix if rng.random() < 0.7 else [])]
        elif kind == 2:
            tokens = structured(rng.randint(0, 128))
        else:
            tokens = mutated()
        yield [*tokens, stop] if rng.random() < 0.5 else tokens


async def _run_game_tools(messages: list[Message]) -> list[Message]:
    """Each message's tool calls through the game env, as a step would run them."""
    results = []
    for message in messages:
        env = ToolUseGameEnv()
        await env.reset(GAME_TASK)
        results.append((await env.step(message)).messages[-1])
    return results


@pytest.mark.slow
def test_fuzz_10_5_replies_parse_with_zero_exceptions_in_bounded_time(codec, tokenizer):
    """10^5 replies: each parses or fails cleanly, in < PARSE_TIME_LIMIT_S, what parses is plain,
    and its final answer scores and its tool calls run. About a minute on a shared 2-core machine."""
    rng = random.Random(20240610)
    parsed = failed = 0
    with_calls: list[Message] = []
    slowest, slowest_tokens = 0.0, []
    for tokens in _fuzz_replies(codec, tokenizer, rng):
        try:
            result, elapsed = timed_parse(codec, tokens)
        except Exception as exc:  # the property under test: report the reply that raised
            pytest.fail(f"Codec.parse raised {exc!r} on tokens {tokens[:200]}")
        if elapsed > slowest:
            slowest, slowest_tokens = elapsed, tokens
        assert_well_formed(result)
        if result.message is None:
            failed += 1
            continue
        parsed += 1
        if result.message.get("tool_calls"):
            with_calls.append(result.message)
        else:
            assert numbers_match(result.message["content"], 42) in (True, False)
    assert parsed + failed == NUM_FUZZ_REPLIES
    # A parse that looked slow is timed again: on a shared machine a single wall-clock reading can
    # include seconds in which the process was not scheduled; the parse's own cost is the fastest
    # of three.
    retimed = min(timed_parse(codec, slowest_tokens)[1] for _ in range(3))
    assert retimed < PARSE_TIME_LIMIT_S, f"slowest parse took {retimed:.3f} s (first reading {slowest:.3f} s)"
    # The mix reaches every outcome: plain replies, tool calls, and failures.
    assert parsed > 1000 and failed > 1000 and len(with_calls) > 100, (parsed, failed, len(with_calls))
    tool_replies = asyncio.run(_run_game_tools(with_calls[:2000]))
    assert all(reply["role"] == "tool" and isinstance(reply["content"], str) for reply in tool_replies)
