"""Codecs: rendering, token-exact multi-turn, parsing, and history rewrites (a Qwen3-like template).

All offline and fast: the embedded SmolLM2 tokenizer, no model.
"""

from __future__ import annotations

import json
import re

import pytest

from cookbook_lib.codecs import (
    ChatMLHermesCodec,
    ChatTemplateCodec,
    Codec,
    UnsupportedChatTemplateError,
    make_codec,
)
from cookbook_lib.runtime.models import load_tokenizer
from cookbook_lib.types import Message, ToolSpec, make_tool_call

LOOKUP = ToolSpec(
    type="function",
    function={
        "name": "lookup",
        "description": "Look up the value of a fact.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
)
CALCULATOR = ToolSpec(
    type="function",
    function={
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
)
SPECS = [LOOKUP, CALCULATOR]

# A minimal Qwen3-like template, faithful to what matters here: tools in the system turn, tool calls
# as <tool_call> blocks, tool results inside user turns, and <think> kept only in assistant turns
# after the last user query (and written empty into the last turn while it is last).
QWEN3_LIKE_TEMPLATE = r"""
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
  {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
  {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
  {%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' %}
    {%- set content = m.content %}
    {%- set think = '' %}
    {%- if m.reasoning_content is string %}
      {%- set think = m.reasoning_content %}
    {%- elif '</think>' in content %}
      {%- set think = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\n' }}
    {%- if loop.index0 > ns.last_query and (loop.last or think) %}
      {{- '<think>\n' + think + '\n</think>\n\n' }}
    {%- endif %}
    {{- content }}
    {%- for call in m.tool_calls or [] %}
      {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
      {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
      {{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}
    {{- '<think>\n\n</think>\n\n' }}
  {%- endif %}
{%- endif %}
"""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def codec(tokenizer) -> ChatMLHermesCodec:
    return ChatMLHermesCodec(tokenizer)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    tokenizer = load_tokenizer()  # a separate object: the template change must not leak
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>"])
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    return tokenizer


def call(call_id: str, name: str, **arguments: object):
    return make_tool_call(call_id, name, dict(arguments))


def assistant(content: str, *calls) -> Message:
    message = Message(role="assistant", content=content)
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool(content: str, name: str = "lookup") -> Message:
    return Message(role="tool", content=content, name=name, tool_call_id="x")


def calls_of(message: Message) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ]


# An episode as (assistant reply, the messages the environment appends after it).
EPISODE: list[tuple[Message, list[Message]]] = [
    (
        assistant("I need both facts.", call("1", "lookup", key="a"), call("2", "lookup", key="b")),
        [tool("17"), tool("25")],
    ),
    (assistant("", call("3", "calculator", expression="17 + 25")), [tool("42", "calculator")]),
    (assistant("The answer is 42."), [Message(role="user", content="And a times two?")]),
    (assistant("", call("4", "calculator", expression="17 * 2")), [tool("34", "calculator")]),
]
OPENING = [
    Message(role="system", content="Use the tools, then reply with only the final number."),
    Message(role="user", content="What is a plus b? Look both up."),
]


# --- choosing a codec ---


def test_make_codec_picks_by_template(tokenizer, qwen_tokenizer):
    assert type(make_codec(tokenizer)) is ChatMLHermesCodec
    assert type(make_codec(qwen_tokenizer)) is ChatTemplateCodec


@pytest.mark.parametrize(
    ("template", "complaint"),
    [
        (None, "no chat template"),
        ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}", "neither"),
        (
            "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
            "neither renders assistant tool calls",
        ),
        (  # writes calls, but in a form no format reads: refused with what it wrote and the known families
            "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}"
            "CALL {{ c.function.name }}"
            "({{ c.function.arguments | tojson }}){% endfor %}<|im_end|>{% endfor %}",
            r"writes tool calls as 'CALL lookup\(.*Known families: .*gpt-oss",
        ),
    ],
)
def test_make_codec_refuses_other_templates(template, complaint):
    tokenizer = load_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(UnsupportedChatTemplateError, match=complaint):
        make_codec(tokenizer)


def test_chatml_codec_refuses_a_template_it_would_not_match():
    tokenizer = load_tokenizer()  # ChatML-looking, but no newline after <|im_end|>
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(UnsupportedChatTemplateError, match="differently"):
        ChatMLHermesCodec(tokenizer)


# --- ChatML rendering ---


@pytest.mark.parametrize(
    "messages",
    [
        [Message(role="user", content="Hi!")],  # the template's default system prompt
        OPENING,
        [*OPENING, assistant("Seventeen."), Message(role="user", content="Thanks\n\n  bye ")],
        [*OPENING, tool("17"), tool("a\nb")],  # a tool turn is what the template writes for role "tool"
    ],
)
def test_render_without_tools_is_the_tokenizers_template(codec, tokenizer, messages):
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert codec.render_prompt(messages, []) == expected["input_ids"]


def test_tools_go_at_the_end_of_the_system_message(codec, tokenizer):
    text = tokenizer.decode(codec.render_prompt(OPENING, SPECS))
    system, user = OPENING[0]["content"], OPENING[1]["content"]
    assert text.startswith(f"<|im_start|>system\n{system}\n\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(LOOKUP)}\n{json.dumps(CALCULATOR)}\n</tools>" in text
    results_line = (
        "The result of each call comes back in a turn with the role tool, in the order of the calls."
    )
    assert text.endswith(
        f"</tool_call>\n\n{results_line}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.count("<|im_start|>system") == 1
    # No system message: the template's default one, with the tools appended.
    text = tokenizer.decode(codec.render_prompt(OPENING[1:], SPECS))
    assert text.startswith(f"<|im_start|>system\n{codec.default_system_prompt}\n\n# Tools\n\n")


def test_stop_tokens_and_close_turn(codec, tokenizer):
    im_end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.encode("\n")
    assert codec.stop_token_ids == [im_end]  # SmolLM2's eos is <|im_end|> too
    assert codec.close_turn([5, im_end]) == newline
    assert codec.close_turn([5, 6]) == [im_end, *newline]  # stopped by length
    assert codec.close_turn([]) == [im_end, *newline]


# --- token-exact multi-turn ---


def play(codec: Codec, stopped_by: str) -> tuple[list[int], list[Message], list[list[int]]]:
    """Play EPISODE through the incremental path; check each next prompt against a full render."""
    messages = list(OPENING)
    sequence = codec.render_prompt(messages, SPECS)
    samples = []
    for reply, appended in EPISODE:
        sampled = codec.render_assistant(reply)
        if stopped_by == "length":
            sampled = sampled[:-1]
        parsed = codec.parse(sampled).message
        assert parsed is not None and parsed["content"] == reply["content"]
        assert calls_of(parsed) == calls_of(reply)
        messages.append(parsed)
        continuation = codec.render_continuation(messages, sampled, appended, SPECS)
        assert not continuation.restarted
        sequence = sequence + sampled + codec.close_turn(sampled) + continuation.tokens
        messages += appended
        assert sequence == codec.render_prompt(messages, SPECS)
        samples.append(sampled)
    return sequence, messages, samples


@pytest.mark.parametrize("stopped_by", ["end_of_turn", "length"])
def test_incremental_render_equals_full_render(codec, stopped_by):
    _, _, samples = play(codec, stopped_by)
    assert all(s[-1] == codec.end_of_turn_id for s in samples) == (stopped_by == "end_of_turn")


def test_decode_reencode_hazard(codec, tokenizer):
    """Why the sampled tokens are kept: the same text has other tokenizations, and a model can
    sample one of them. Re-encoding the decoded reply would train on tokens it never sampled."""
    canonical = tokenizer.encode(" answer", add_special_tokens=False)
    split = tokenizer.convert_tokens_to_ids(["Ġans", "wer"])
    assert len(canonical) == 1 and tokenizer.decode(split) == " answer"
    sampled = [*tokenizer.encode("The", add_special_tokens=False), *split]
    sampled += encode_reply(codec, " is 42.")
    parsed = codec.parse(sampled)
    assert parsed.message == assistant("The answer is 42.")
    assert tokenizer.encode(parsed.text, add_special_tokens=False) != sampled[:-1]

    prompt = codec.render_prompt(OPENING, SPECS)
    follow_up = [Message(role="user", content="Sure?")]
    continuation = codec.render_continuation([*OPENING, parsed.message], sampled, follow_up, SPECS)
    incremental = prompt + sampled + codec.close_turn(sampled) + continuation.tokens
    rerendered = codec.render_prompt([*OPENING, parsed.message, *follow_up], SPECS)
    assert tokenizer.decode(incremental) == tokenizer.decode(rerendered)
    assert incremental != rerendered  # same text, different tokens
    assert incremental[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert incremental[-len(continuation.tokens) :] == rerendered[-len(continuation.tokens) :]


def test_continuation_needs_the_assistant_turn_last(codec, qwen_tokenizer):
    for each in (codec, ChatTemplateCodec(qwen_tokenizer)):
        with pytest.raises(ValueError, match="must end with the assistant message"):
            each.render_continuation(OPENING, [1], [tool("1")], SPECS)


# --- parsing ---


def encode_reply(codec: Codec, text: str) -> list[int]:
    """``text`` as a model would sample it, stopping on the end-of-turn token."""
    return [*codec.tokenizer.encode(text, add_special_tokens=False), codec.end_of_turn_id]


def parse_text(codec: Codec, text: str):
    return codec.parse(encode_reply(codec, text))


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("The answer is 42.", "The answer is 42.", []),
        (
            '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>',
            "",
            [("lookup", {"key": "a"})],
        ),
        ('<tool_call>{"name":"lookup","arguments":{}}</tool_call>', "", [("lookup", {})]),  # compact
        (
            'Checking both.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2", "n": [1, {"é": null}]}}'
            "\n</tool_call>",
            "Checking both.",
            [("lookup", {"key": "a"}), ("calculator", {"expression": "1 + 2", "n": [1, {"é": None}]})],
        ),
        (
            'Before.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nAfter. ',
            "Before.\nAfter.",
            [("f", {})],
        ),
    ],
)
def test_parse_replies(codec, text, content, calls):
    result = parse_text(codec, text)
    assert result.ok and result.error is None and result.text == text
    assert result.message["role"] == "assistant" and result.message["content"] == content
    assert calls_of(result.message) == calls
    assert ("tool_calls" in result.message) == bool(calls)
    for tool_call in result.message.get("tool_calls", []):
        assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")


def test_call_ids_are_unique(codec):
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 3
    ids = [c["id"] for _ in range(2) for c in parse_text(codec, text).message["tool_calls"]]
    assert len(set(ids)) == 6


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}', "unclosed <tool_call>"),
        ('<tool_call>{"name": "f", "arguments": {}}<tool_call>{}</tool_call>', "not closed before the next"),
        ("Done.</tool_call>", "stray </tool_call>"),
        ('<tool_call>{"name": "f", "arguments": {"key": "a"}</tool_call>', "not valid JSON"),
        ("<tool_call></tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>', "not valid JSON"),
        ('<tool_call>[{"name": "f", "arguments": {}}]</tool_call>', "must be a JSON object"),
        ('<tool_call>"lookup"</tool_call>', "must be a JSON object"),
        (
            '<tool_call>{"name": "f", "arguments": ["a"]}</tool_call>',
            '"arguments" must be a JSON object, got a JSON array',
        ),
        ('<tool_call>{"name": "f", "arguments": "{\\"key\\": 1}"}</tool_call>', "got a JSON string"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "non-empty string, got a JSON number"),
        ('<tool_call>{"name": " ", "arguments": {}}</tool_call>', "got a blank string"),
        ('<tool_call>{"name": "f"}</tool_call>', 'has no "arguments"'),
        (
            '<tool_call>{"function": {"name": "f", "arguments": {}}}</tool_call>',
            "unexpected keys \\['function'\\]",
        ),
        ('<tool_call>{"name": "f", "arguments": {}, "id": 1}</tool_call>', "unexpected keys \\['id'\\]"),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>',
            "tool call 2",
        ),
    ],
)
def test_parse_failures(codec, text, error):
    result = parse_text(codec, text)
    assert result.message is None and not result.ok
    assert result.error is not None
    assert re.search(error, result.error), result.error
    assert result.text == text  # kept for the episode record


@pytest.mark.parametrize(
    "reply", [reply for reply, _ in EPISODE] + [assistant("Ünïcode: ✓", call("9", "f", q="✓"))]
)
def test_render_then_parse_gives_the_message_back(codec, reply):
    sampled = codec.render_assistant(reply)
    assert sampled[-1] == codec.end_of_turn_id
    parsed = codec.parse(sampled).message
    assert parsed["content"] == reply["content"] and calls_of(parsed) == calls_of(reply)


def test_render_refuses_arguments_that_are_not_a_json_object(codec):
    bad = assistant("", make_tool_call("1", "f", "[1, 2]"))
    with pytest.raises(ValueError, match="must be a JSON object"):
        codec.render_assistant(bad)


# --- a template that rewrites history (Qwen3-like) ---


def test_chat_template_codec_renders_with_the_template(qwen_tokenizer):
    codec = ChatTemplateCodec(qwen_tokenizer)
    expected = qwen_tokenizer.apply_chat_template(
        OPENING, tools=SPECS, add_generation_prompt=True, tokenize=False
    )
    assert qwen_tokenizer.decode(codec.render_prompt(OPENING, SPECS)) == expected
    assert codec.stop_token_ids == [qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    no_thinking = ChatTemplateCodec(qwen_tokenizer, template_kwargs={"enable_thinking": False})
    assert qwen_tokenizer.decode(no_thinking.render_prompt(OPENING, SPECS)).endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_codec_is_token_exact_while_history_holds(qwen_tokenizer):
    """Thinking replies and tool results only: the template keeps every <think>, nothing restarts."""
    codec = ChatTemplateCodec(qwen_tokenizer)
    messages = list(OPENING)
    sequence = codec.render_prompt(messages, SPECS)
    for number, (reply, appended) in enumerate(EPISODE[:2]):
        thinking = assistant(
            f"<think>\nStep {number}.\n</think>\n\n{reply['content']}", *reply.get("tool_calls", [])
        )
        sampled = codec.render_assistant(thinking)
        parsed = codec.parse(sampled).message
        assert calls_of(parsed) == calls_of(reply)
        messages.append(parsed)
        continuation = codec.render_continuation(messages, sampled, appended, SPECS)
        assert not continuation.restarted
        sequence = sequence + sampled + codec.close_turn(sampled) + continuation.tokens
        messages += appended
        assert sequence == codec.render_prompt(messages, SPECS)
    assert "Step 0." in qwen_tokenizer.decode(sequence)


@pytest.mark.parametrize(
    ("reply", "appended", "restarted"),
    [
        (
            "<think>\nLook a up.\n</think>\n\n"
            + '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>',
            [tool("17")],
            False,
        ),
        # A new user query: the template drops the <think> of every earlier assistant turn.
        ("<think>\nIt is 42.\n</think>\n\nThe answer is 42.", [Message(role="user", content="Sure?")], True),
        # No <think> sampled: the template writes an empty one into a last turn and drops it once the
        # turn is not last, but that is no rewrite of what the model saw.
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>', [tool("17")], False),
        ("The answer is 42.", [Message(role="user", content="Sure?")], False),
    ],
)
def test_chat_template_codec_restarts_exactly_where_history_is_rewritten(
    qwen_tokenizer, reply, appended, restarted
):
    codec = ChatTemplateCodec(qwen_tokenizer)
    prompt = codec.render_prompt(OPENING, SPECS)
    sampled = encode_reply(codec, reply)
    history = [*OPENING, codec.parse(sampled).message]
    continuation = codec.render_continuation(history, sampled, appended, SPECS)
    assert continuation.restarted is restarted
    full = codec.render_prompt([*history, *appended], SPECS)
    incremental = prompt + sampled + codec.close_turn(sampled)
    if restarted:
        assert continuation.tokens == full
        assert full[: len(incremental)] != incremental  # what the model saw is not in the fresh prompt
    else:
        assert incremental + continuation.tokens == full
    if "It is 42." in reply:
        assert "It is 42." not in qwen_tokenizer.decode(continuation.tokens)


def test_without_thinking_every_turn_restarts(qwen_tokenizer):
    """With enable_thinking=False the model is shown an empty <think> block that the template drops
    from every earlier turn: what the model saw is never in the next fresh render."""
    codec = ChatTemplateCodec(qwen_tokenizer, template_kwargs={"enable_thinking": False})
    sampled = encode_reply(codec, "The answer is 42.")
    history = [*OPENING, codec.parse(sampled).message]
    continuation = codec.render_continuation(history, sampled, [tool("17")], SPECS)
    assert continuation.restarted
    assert continuation.tokens == codec.render_prompt([*history, tool("17")], SPECS)
    assert codec.render_assistant(history[-1]) == sampled  # the empty block is in the prompt, not the reply
