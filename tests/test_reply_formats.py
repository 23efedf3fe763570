"""Each family's reply format on text: what it reads, what it refuses, and reasoning kept apart.

Fast and model-free: the formats see only text (the codecs add tokens and templates; see
tests/test_codec_families.py for the formats behind real templates).
"""

from __future__ import annotations

import pytest

from cookbook_lib.codecs.gemma4 import Gemma4Format
from cookbook_lib.codecs.glm import GLMFormat
from cookbook_lib.codecs.harmony import HarmonyFormat
from cookbook_lib.codecs.hermes import HermesFormat
from cookbook_lib.codecs.llama3 import Llama3JSONFormat
from cookbook_lib.codecs.pythonic import PythonicFormat
from cookbook_lib.codecs.qwen_xml import QwenXMLFormat
from cookbook_lib.codecs.reply import (
    MAX_REPLY_CHARS,
    THINK_TAGS,
    ParsedReply,
    ToolCallFormatError,
    typed_value,
)
from cookbook_lib.types import ToolSpec

SPECS = [
    ToolSpec(
        type="function",
        function={
            "name": "lookup",
            "description": "d",
            "parameters": {
                "type": "object",
                "properties": {
                    "key": {"type": "string"},
                    "count": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array"},
                    "when": {"type": ["string", "null"]},
                },
            },
        },
    )
]


# --- reasoning blocks ---


@pytest.mark.parametrize(
    ("text", "in_reasoning", "reasoning", "rest"),
    [
        ("<think>\nR\n</think>\n\n42", False, "R", "\n\n42"),
        ("R\n</think>\n\n42", True, "R", "\n\n42"),  # the prompt opened the block (Qwen3.6)
        ("\n</think>\n\n42", True, "", "\n\n42"),  # an empty block
        ("R\n</think>42", False, "R", "42"),  # a closing tag alone: the prompt opened it
        ("still thinking", True, "still thinking", ""),  # cut off inside the block
        ("42", False, None, "42"),
        ("Answer first <think>x</think>", False, None, "Answer first <think>x</think>"),
    ],
)
def test_think_blocks_split_from_the_answer(text, in_reasoning, reasoning, rest):
    assert THINK_TAGS.split(text, in_reasoning=in_reasoning) == (reasoning, rest)


def test_hermes_with_think_tags_keeps_reasoning_out_of_the_content():
    reply = HermesFormat(THINK_TAGS).parse(
        "<think>\nI need a.\n</think>\n\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>',
        SPECS,
    )
    assert reply == ParsedReply(content="", calls=[("lookup", {"key": "a"})], reasoning="I need a.")
    assert HermesFormat(THINK_TAGS).parse("<think>\n\n</think>\n\n42", SPECS).content == "42"
    # Without tags (Qwen2.5, the embedded model) a <think> stays text, as the template would show it.
    assert HermesFormat().parse("<think>x</think>42", SPECS).content == "<think>x</think>42"


# --- Qwen3.5+ XML ---


def test_qwen_xml_types_values_by_the_tool_schema():
    text = (
        "Let me look.\n\n<tool_call>\n<function=lookup>\n<parameter=key>\n42\n</parameter>\n"
        "<parameter=count>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=when>\nnull\n</parameter>\n'
        '<parameter=extra>\n{"x": 1}\n</parameter>\n</function>\n</tool_call>'
    )
    reply = QwenXMLFormat().parse(text, SPECS)
    assert reply.content == "Let me look."
    assert reply.calls == [
        (
            "lookup",
            {"key": "42", "count": 3, "ratio": 0.5, "tags": ["a", "b"], "when": None, "extra": {"x": 1}},
        )
    ]


def test_qwen_xml_keeps_multi_line_values_and_wrong_types_for_the_tool_to_report():
    text = (
        "<tool_call>\n<function=lookup>\n<parameter=key>\nline one\nline two\n</parameter>\n"
        "<parameter=count>\nthree\n</parameter>\n</function>\n</tool_call>"
    )
    assert QwenXMLFormat().parse(text, SPECS).calls == [
        ("lookup", {"key": "line one\nline two", "count": "three"})
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>\n<function=lookup>\n<parameter=key>\na\n</function>\n</tool_call>", "not closed"),
        ("<tool_call>\n<function=lookup>\n</tool_call>", "exactly one <function="),
        ("<tool_call>\n<function=lookup>\nstray\n</function>\n</tool_call>", "text outside"),
        ("<tool_call>\n<function=look up>\n</function>\n</tool_call>", "not a tool name"),
        (
            "<tool_call>\n<function=lookup>\n<parameter=key>\na\n</parameter>\n<parameter=key>\nb\n</parameter>\n</function>\n</tool_call>",
            "twice",
        ),
        ("<tool_call>\n<function=lookup>\n</function>", "unclosed"),
        ("</tool_call>", "stray"),
    ],
)
def test_qwen_xml_refuses_malformed_calls(text, error):
    with pytest.raises(ToolCallFormatError, match=error):
        QwenXMLFormat().parse(text, SPECS)


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("3", {"type": "string"}, "3"),
        ("3", {"type": "integer"}, 3),
        ("3", {"type": "number"}, 3),
        ("true", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ("[1]", {"anyOf": [{"type": "array"}, {"type": "null"}]}, [1]),
        ('"quoted"', None, '"quoted"'),  # unknown parameter: only non-string JSON is decoded
        ("NaN", {"type": "number"}, "NaN"),  # not plain JSON: the tool sees the text
    ],
)
def test_typed_values(raw, schema, value):
    assert typed_value(raw, schema) == value


# --- Llama 3 ---


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        ('{"name": "lookup", "parameters": {"key": "a"}}', [("lookup", {"key": "a"})], ""),
        ('<|python_tag|>{"name": "lookup", "arguments": {"key": "a"}}', [("lookup", {"key": "a"})], ""),
        ("  The answer is 42. ", [], "The answer is 42."),
    ],
)
def test_llama3_reads_one_bare_json_call(text, calls, content):
    reply = Llama3JSONFormat().parse(text, SPECS)
    assert (reply.calls, reply.content) == (calls, content)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"name": "lookup", "parameters": {"key": "a"}} and more', "Extra data"),
        ('{"name": "lookup"}', 'no "parameters"'),
        ('{"name": "lookup", "parameters": [1]}', "must be a JSON object"),
        ('{"name": "lookup", "parameters": {}, "x": 1}', "unexpected keys"),
        ("<|python_tag|>brave_search.call(query='x')", "built-in tools"),
    ],
)
def test_llama3_refuses_malformed_calls(text, error):
    with pytest.raises(ToolCallFormatError, match=error):
        Llama3JSONFormat().parse(text, SPECS)


# --- harmony ---


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.lookup <|constrain|>json",  # as models write it
        " to=functions.lookup<|channel|>commentary json",  # as the template writes it
    ],
)
def test_harmony_reads_analysis_and_a_call_in_either_header_order(header):
    text = f'<|channel|>analysis<|message|>Need a.<|end|><|start|>assistant{header}<|message|>{{"key": "a"}}'
    reply = HarmonyFormat().parse(text, SPECS)
    assert reply == ParsedReply(content="", calls=[("lookup", {"key": "a"})], reasoning="Need a.")


def test_harmony_final_answer_is_the_content():
    text = "<|channel|>analysis<|message|>6*7<|end|><|start|>assistant<|channel|>final<|message|>42"
    assert HarmonyFormat().parse(text, SPECS) == ParsedReply(content="42", reasoning="6*7")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("plain text", "no <|message|>"),
        ("<|channel|>commentary to=browser.search<|message|>{}", "built-in"),
        (
            '<|channel|>commentary to=functions.lookup<|message|>{"key": "a"}<|end|>'
            "<|start|>assistant<|channel|>final<|message|>x",
            "follows a tool call",
        ),
        ("<|channel|>chatter<|message|>x", "unknown channel"),
        ("<|channel|>final<|message|>x<|end|><|start|>user<|message|>y", "not from the assistant"),
        ("<|channel|>final<|message|>x<|start|>assistant<|channel|>final<|message|>y", "does not end with"),
        ("<|channel|>commentary to=functions.lookup<|message|>[1]", "must be a JSON object"),
    ],
)
def test_harmony_refuses_what_is_not_a_harmony_reply(text, error):
    with pytest.raises(ToolCallFormatError, match=error):
        HarmonyFormat().parse(text, SPECS)


# --- Gemma 4 ---


def test_gemma4_reads_its_argument_notation():
    text = (
        "<|channel>thought\nneed both\n<channel|>"
        '<|tool_call>call:lookup{key:<|"|>a, b: c<|"|>,count:-3,ratio:2.5e-1,tags:[<|"|>x<|"|>,true,null],'
        "nested:{inner:{deep:[1,2]}}}<tool_call|><|tool_call>call:lookup{}<tool_call|>"
    )
    reply = Gemma4Format().parse(text, SPECS)
    assert reply.reasoning == "need both"
    assert reply.calls == [
        (
            "lookup",
            {
                "key": "a, b: c",
                "count": -3,
                "ratio": 0.25,
                "tags": ["x", True, None],
                "nested": {"inner": {"deep": [1, 2]}},
            },
        ),
        ("lookup", {}),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<|tool_call>call:lookup{key:<|"|>a}<tool_call|>', "unclosed string"),
        ("<|tool_call>call:lookup{key:1 2}<tool_call|>", "expected ',' or '}'"),
        ("<|tool_call>lookup{key:1}<tool_call|>", "call:NAME"),
        ("<|tool_call>call:lookup{key:1,key:2}<tool_call|>", "twice"),
        ("<|tool_call>call:lookup{key:" + "[" * 100 + "]" * 100 + "}<tool_call|>", "nested deeper"),
        ("<|tool_call>call:lookup{key:1" + "0" * 400 + "}<tool_call|>", "more than"),
        ("<|tool_call>call:lookup{key:1}", "unclosed"),
    ],
)
def test_gemma4_refuses_malformed_calls(text, error):
    with pytest.raises(ToolCallFormatError, match=error):
        Gemma4Format().parse(text, SPECS)


# --- GLM ---


def test_glm_reads_arg_pairs_typed_by_the_schema():
    text = (
        "\n<think>need a</think>\nLooking.\n<tool_call>lookup\n"
        "<arg_key>key</arg_key>\n<arg_value>7</arg_value>\n"
        "<arg_key>count</arg_key>\n<arg_value>7</arg_value>\n</tool_call>"
    )
    reply = GLMFormat().parse(text, SPECS)
    assert reply == ParsedReply(
        content="Looking.", calls=[("lookup", {"key": "7", "count": 7})], reasoning="need a"
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>lookup\n<arg_key>key</arg_key>\n</tool_call>", "expected <arg_key>"),
        ("<tool_call>\n<arg_key>key</arg_key><arg_value>a</arg_value></tool_call>", "not a tool name"),
        ("<tool_call>lookup\n<arg_key>key</arg_key><arg_value>a</arg_value>", "unclosed"),
    ],
)
def test_glm_refuses_malformed_calls(text, error):
    with pytest.raises(ToolCallFormatError, match=error):
        GLMFormat().parse(text, SPECS)


# --- pythonic (LFM2.5) ---


def test_pythonic_reads_literals_in_python_and_json_spellings():
    text = (
        "<think>both</think>Sure.<|tool_call_start|>[lookup(key='a', count=3), "
        'lookup(key="b", tags=[1, -2.5, None], extra={"on": true, "off": null})]<|tool_call_end|>'
    )
    reply = PythonicFormat().parse(text, SPECS)
    assert reply == ParsedReply(
        content="Sure.",
        calls=[
            ("lookup", {"key": "a", "count": 3}),
            ("lookup", {"key": "b", "tags": [1, -2.5, None], "extra": {"on": True, "off": None}}),
        ],
        reasoning="both",
    )


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("[lookup('a')]", "positional"),
        ("[os.system(cmd='x')]", "plain tool name"),
        ("[lookup(key=__import__('os'))]", "not a literal"),
        ("[lookup(key=1 + 2)]", "not a literal"),
        ("[lookup(**kw)]", "unpacks"),
        ("lookup(key='a')", "must be a list"),
        ("[lookup(key='a'", "not a Python list"),
        ("[lookup(key=" + "[" * 300 + "]" * 300 + ")]", "not a Python list|nested deeper"),
        ("[lookup(key=1" + "0" * 5000 + ")]", "not a Python list|more than"),
    ],
)
def test_pythonic_never_evaluates_and_refuses_non_literals(body, error):
    with pytest.raises(ToolCallFormatError, match=error):
        PythonicFormat().parse(f"<|tool_call_start|>{body}<|tool_call_end|>", SPECS)


# --- all formats ---

ALL_FORMATS = [
    HermesFormat(THINK_TAGS),
    QwenXMLFormat(),
    Llama3JSONFormat(),
    HarmonyFormat(),
    Gemma4Format(),
    GLMFormat(),
    PythonicFormat(),
]


@pytest.mark.parametrize("reply_format", ALL_FORMATS, ids=lambda f: f.name)
def test_every_format_refuses_a_runaway_reply_before_scanning_it(reply_format):
    with pytest.raises(ToolCallFormatError, match="characters long"):
        reply_format.parse("x" * (MAX_REPLY_CHARS + 1), SPECS)
