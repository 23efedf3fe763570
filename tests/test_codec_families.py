"""Every model family's real chat template, as it ships: the right codec, the self-check, a whole
tool-use episode through it, reasoning kept out of scored answers, and hostile replies.

The templates are read from TRL 1.16's wheel (``cookbook_lib/codecs/reference.py`` names each one's
source) and put on the embedded tokenizer with the special tokens they write. No model is loaded:
replies are "sampled" by a scripted generator that returns the tokens a model would sample.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_model_rollout import ScriptedGenerator

from cookbook_lib.codecs import (
    ChatTemplateCheckError,
    ChatTemplateCodec,
    ParseResult,
    UnsupportedChatTemplateError,
    check_codec,
    make_codec,
)
from cookbook_lib.codecs.reference import (
    REFERENCE_TEMPLATES,
    reference_template_text,
    reference_tokenizer,
    shipped_template_files,
    shipped_template_text,
)
from cookbook_lib.codecs.reply import MAX_REPLY_CHARS
from cookbook_lib.generators import SamplingParams
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.runtime.models import load_tokenizer
from cookbook_lib.types import Message
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks, make_tool_use_game_expert

# The reply format each shipped template must get.
EXPECTED_FORMAT = {
    "qwen2_5": "hermes-json",
    "qwen3": "hermes-json",
    "qwen3_instruct_2507": "hermes-json",
    "qwen3_5_think": "qwen-xml",
    "qwen3_5_nothink": "qwen-xml",
    "qwen3_6": "qwen-xml",
    "qwen3_8": "qwen-xml",
    "llama3_1": "llama3-json",
    "llama3_2": "llama3-json",
    "gptoss": "harmony",
    "gemma4": "gemma4",
    "glm4moe": "glm-xml",
    "lfm2_5": "pythonic",
    "gemma4_release": "gemma4",
    "lfm2_5_release": "pythonic",
    "lfm2": "pythonic",
    "nemotron_3_nano": "qwen-xml",
}
# Templates with a thinking switch, and the values to check.
THINKING = {
    "qwen3": (True, False),
    "qwen3_5_think": (False,),
    "qwen3_5_nothink": (True,),
    "qwen3_6": (False,),
    "qwen3_8": (False,),
    "glm4moe": (False,),
    "gemma4": (True,),
    "nemotron_3_nano": (False,),
}
NAMES = list(EXPECTED_FORMAT)


def test_every_reference_template_is_tested():
    assert set(NAMES) == set(REFERENCE_TEMPLATES)


@pytest.fixture(scope="module")
def base_tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def family_tokenizers(base_tokenizer):
    return {name: reference_tokenizer(name, base_tokenizer) for name in NAMES}


@pytest.fixture(scope="module")
def codecs(family_tokenizers):
    return {name: make_codec(tokenizer) for name, tokenizer in family_tokenizers.items()}


@pytest.mark.parametrize("name", NAMES)
def test_make_codec_picks_the_format_the_template_writes(codecs, name):
    codec = codecs[name]
    assert isinstance(codec, ChatTemplateCodec)
    assert codec.reply_format.name == EXPECTED_FORMAT[name]


@pytest.mark.parametrize("name", NAMES)
def test_every_probe_of_the_self_check_passes(codecs, name):
    report = check_codec(codecs[name])
    assert report.failed == [], report.lines()
    assert {probe.name for probe in report.probes} == {
        "one call", "parallel calls", "consecutive tool messages", "reasoning", "plain answer", "continuation"
    }  # fmt: skip


@pytest.mark.parametrize(("name", "thinking"), [(n, t) for n, values in THINKING.items() for t in values])
def test_the_thinking_switch_reaches_every_render(family_tokenizers, name, thinking):
    codec = make_codec(family_tokenizers[name], enable_thinking=thinking)
    assert codec.template_kwargs == {"enable_thinking": thinking}
    prompt = codec.tokenizer.decode(codec.render_prompt([Message(role="user", content="hi")], []))
    other = make_codec(family_tokenizers[name], enable_thinking=not thinking)
    assert prompt != other.tokenizer.decode(other.render_prompt([Message(role="user", content="hi")], []))
    if codec.reply_format.reasoning_tags is not None and not thinking:
        assert codec.prompt_closes_reasoning and not codec.can_reason


@pytest.mark.parametrize("name", ["llama3_1", "gptoss", "qwen2_5", "lfm2_5"])
def test_a_thinking_switch_the_template_lacks_is_refused(family_tokenizers, name):
    with pytest.raises(UnsupportedChatTemplateError, match="has no enable_thinking switch"):
        make_codec(family_tokenizers[name], enable_thinking=False)


def test_a_fork_of_a_template_is_served_by_what_it_writes(base_tokenizer):
    """TRL detects templates by exact text, so a fine-tune's edited copy loses its parser; here the
    format is found by rendering, so an edited Qwen3.6 template still gets the XML codec."""
    text = reference_template_text("qwen3_6").replace(
        "You have access to the following functions", "Tools you may use"
    )
    tokenizer = reference_tokenizer("qwen3_6", base_tokenizer)
    tokenizer.chat_template = "{#- a fine-tune's copy #}\n" + text
    codec = make_codec(tokenizer)
    assert codec.reply_format.name == "qwen-xml"


def test_a_template_that_breaks_a_probe_is_refused_naming_it(base_tokenizer):
    """A template that writes XML calls but renders every tool result as nothing at all."""
    tokenizer = reference_tokenizer("qwen3_6", base_tokenizer)
    tokenizer.chat_template = reference_template_text("qwen3_6").replace(
        "{{- content }}\n        {{- '\\n</tool_response>' }}", "{{- '\\n</tool_response>' }}"
    )
    assert tokenizer.chat_template != reference_template_text("qwen3_6")
    with pytest.raises(
        ChatTemplateCheckError, match=r"probe 'consecutive tool messages'.*not in the rendered"
    ):
        make_codec(tokenizer)


# --- a whole episode through each codec ---

TASK = next(task for task in load_tool_use_game_tasks("val") if task.metadata["tier"] == 2)
REASONING = "I should use the tools."


def expert_replies() -> list[Message]:
    expert = make_tool_use_game_expert(TASK)
    episode = asyncio.run(run_episode(lambda _task: ToolUseGameEnv(), TASK, expert, max_turns=8))
    assert episode.reward == 1.0
    return [message for message in episode.messages if message["role"] == "assistant"]


@pytest.mark.parametrize("name", NAMES)
def test_an_expert_episode_plays_token_exactly_through_the_codec(codecs, name):
    """The expert's replies, rendered as the tokens a model of this family would sample, go
    through ModelPolicy, the codec's parser and continuation and the real env: the episode scores
    1.0, every reply's reasoning is apart from its content, and the prompts are one sequence."""
    codec = codecs[name]
    replies = []
    for message in expert_replies():
        reply = dict(message)
        if codec.can_reason:
            reply["reasoning_content"] = REASONING
        replies.append(codec.render_assistant(reply))
    policy = ModelPolicy(
        ScriptedGenerator(replies), codec, SamplingParams(max_tokens=512), max_model_length=8192
    )
    episode = asyncio.run(run_episode(lambda _task: ToolUseGameEnv(), TASK, policy, max_turns=8))
    assert (episode.end_cause, episode.reward) == (EndCause.TERMINATED, 1.0), episode.messages[-1]
    assert len(episode.turns) == len(replies)
    parsed = [message for message in episode.messages if message["role"] == "assistant"]
    for message, tokens in zip(parsed, replies, strict=True):
        # Reasoning where the template rendered it (Gemma 4's release revision drops it from turns
        # that call tools), and never inside the content.
        rendered_reasoning = REASONING in codec.tokenizer.decode(tokens)
        assert message.get("reasoning_content") == (REASONING if rendered_reasoning else None)
        assert "<" not in message["content"] and "think" not in message["content"]
    sequences = episode.token_sequences()
    assert len(sequences) == 1, "a canonical tool loop must not rewrite history"
    # The last prompt holds every earlier turn's sampled tokens, as they were sampled.
    last = episode.turns[-1].prompt_tokens
    for turn in episode.turns[:-1]:
        assert (
            last[len(turn.prompt_tokens) : len(turn.prompt_tokens) + len(turn.sampled_tokens)]
            == turn.sampled_tokens
        )


# --- reasoning is not content: Qwen3's answers score under the seed's MathEnv ---

XML_CALL = (
    "<tool_call>\n<function=calculator>\n<parameter=expression>\n37 * (12 + 5)\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>"
)


@pytest.mark.parametrize(
    ("name", "call", "answer"),
    [
        (
            "qwen3",
            "<think>\nI will use the calculator.\n</think>\n\n<tool_call>\n"
            '{"name": "calculator", "arguments": {"expression": "37 * (12 + 5)"}}\n</tool_call><|im_end|>',
            "<think>\nIt returned 629.\n</think>\n\n629<|im_end|>",
        ),
        (
            "qwen3_6",  # the prompt opens <think>: the reply starts inside it
            "I will use the calculator.\n</think>\n\n" + XML_CALL,
            "It returned 629.\n</think>\n\n629<|im_end|>",
        ),
        (
            "qwen3_8",
            "Calculator.\n</think>\n\n" + XML_CALL,
            "\n</think>\n\n629<|im_end|>",
        ),
    ],
)
def test_qwen3_answers_score_under_the_seed_math_env(codecs, name, call, answer):
    from test_seed_example import TASK as SEED_TASK
    from test_seed_example import MathEnv as SeedMathEnv

    codec = codecs[name]
    replies = [codec.tokenizer.encode(text, add_special_tokens=False) for text in (call, answer)]
    policy = ModelPolicy(
        ScriptedGenerator(replies), codec, SamplingParams(max_tokens=256), max_model_length=8192
    )
    episode = asyncio.run(run_episode(lambda _task: SeedMathEnv(), SEED_TASK, policy, max_turns=4))
    assert episode.messages[3]["content"] == "629"  # the calculator ran
    assert episode.messages[-1]["content"] == "629"
    assert (episode.end_cause, episode.reward) == (EndCause.TERMINATED, 1.0)


# --- hostile replies: a parse failure, never an exception ---

MARKUP = {
    "hermes-json": ["<tool_call>", "</tool_call>", "<think>", "</think>", '{"name": "lookup", "arguments": '],
    "qwen-xml": [
        "<tool_call>", "</tool_call>", "<function=lookup>", "</function>", "<parameter=key>", "</parameter>",
        "</think>",
    ],
    "llama3-json": ["<|python_tag|>", '{"name": "lookup", "parameters": ', '{"name": ', "<|eom_id|>"],
    "harmony": [
        "<|channel|>", "analysis", "final", "commentary", " to=functions.lookup", "<|message|>", "<|end|>",
        "<|start|>assistant", "<|constrain|>json",
    ],
    "gemma4": [
        "<|tool_call>", "<tool_call|>", "call:lookup{", '<|"|>', "<|channel>thought\n", "<channel|>",
        "<|tool_response>",
    ],
    "glm-xml": [
        "<tool_call>", "</tool_call>", "lookup\n", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<think>", "</think>",
    ],
    "pythonic": [
        "<|tool_call_start|>", "<|tool_call_end|>", "[lookup(", "key=", ")]", "'a'", "<think>", "</think>",
    ],
}  # fmt: skip
JSONISH = [
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    '"',
    "\\",
    "1e999",
    "NaN",
    "-0",
    "9" * 400,
    "true",
    "null",
    "\\ud800",
    "\x00",
]


def _hostile_texts(format_name: str) -> st.SearchStrategy[str]:
    pieces = st.sampled_from(MARKUP[format_name] + JSONISH) | st.text(max_size=8)
    return st.lists(pieces, max_size=40).map("".join)


def _assert_parses_or_fails_cleanly(codec, text: str) -> None:
    tokens = codec.tokenizer.encode(text, add_special_tokens=False)
    result = codec.parse(tokens, [])
    assert isinstance(result, ParseResult)
    if result.ok:
        assert isinstance(result.message["content"], str)
        for call in result.message.get("tool_calls", []):
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    else:
        assert isinstance(result.error, str) and result.error


@pytest.mark.parametrize("format_name", list(MARKUP))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_replies_never_raise(codecs, format_name, data):
    name = next(n for n, f in EXPECTED_FORMAT.items() if f == format_name)
    text = data.draw(_hostile_texts(format_name))
    _assert_parses_or_fails_cleanly(codecs[name], text)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_6", "llama3_1", "gptoss", "gemma4", "glm4moe", "lfm2_5"])
def test_huge_nested_and_wrongly_typed_replies_fail_cleanly(codecs, name):
    codec = codecs[name]
    deep = "[" * 5000 + "]" * 5000
    form = {
        "hermes-json": '<tool_call>\n{{"name": "lookup", "arguments": {{"key": {v}}}}}\n</tool_call>',
        "qwen-xml": "<tool_call>\n<function=lookup>\n<parameter=key>\n{v}\n</parameter>\n</function>\n"
        "</tool_call>",
        "llama3-json": '{{"name": "lookup", "parameters": {{"key": {v}}}}}',
        "harmony": '<|channel|>commentary to=functions.lookup<|message|>{{"key": {v}}}',
        "gemma4": "<|tool_call>call:lookup{{key:{v}}}<tool_call|>",
        "glm-xml": "<tool_call>lookup\n<arg_key>key</arg_key>\n<arg_value>{v}</arg_value>\n</tool_call>",
        "pythonic": "<|tool_call_start|>[lookup(key={v})]<|tool_call_end|>",
    }[codec.reply_format.name]
    for value in (deep, "1" * 5000, "1e999", '"' + "x" * (MAX_REPLY_CHARS + 10) + '"', "{}" * 3000):
        _assert_parses_or_fails_cleanly(codec, form.format(v=value))
    # Wrong shapes parse or fail, never raise: a name that is no string, arguments that are a list.
    for text in (
        '<tool_call>\n{"name": 5, "arguments": []}\n</tool_call>',
        '{"name": ["x"], "parameters": 3}',
        "<|tool_call>call:{}<tool_call|>",
    ):
        _assert_parses_or_fails_cleanly(codec, text)


# --- the self-check on its own: python -m cookbook_lib.codecs.check ---


def test_the_check_command_prints_every_probe(capsys):
    from cookbook_lib.codecs.check import main

    assert main(["--reference", "qwen3_6"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_6: ChatTemplateCodec, qwen-xml format" in out
    for probe in ("one call", "parallel calls", "consecutive tool messages", "reasoning", "plain answer"):
        assert f"ok  {probe}" in out


def test_the_check_command_reads_a_model_folder_and_fails_on_a_bad_template(tmp_path, base_tokenizer):
    import subprocess
    import sys

    tokenizer = reference_tokenizer("llama3_1", base_tokenizer)
    tokenizer.save_pretrained(tmp_path / "good")
    (tmp_path / "good" / "config.json").write_text("{}")  # a model folder: the tokenizer alone is read
    done = subprocess.run(
        [sys.executable, "-m", "cookbook_lib.codecs.check", str(tmp_path / "good")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "llama3-json format" in done.stdout and "skipped  parallel calls" in done.stdout

    from cookbook_lib.codecs.check import main

    tokenizer.chat_template = reference_template_text("llama3_1").replace('"parameters": ', '"params": ')
    tokenizer.save_pretrained(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text("{}")
    assert main([str(tmp_path / "bad")]) == 1


# --- every template TRL ships: served, or refused with the reason, never a silent misparse ---

# The markup a template writes, added as special tokens as its tokenizer has them.
_MARKUP_TOKEN = re.compile(
    r"<[|｜][^<>\s'\"]{1,40}?[|｜]>|<\|[a-z_]+>|<[a-z_]+\|>|\[[A-Z_]{3,}\]|</?think>|</?tool_call>|<bos>|<eos>"
)
SERVED = {
    "diffusion_gemma.jinja", "gemma4.jinja", "gemma4_v2.jinja", "gemma4_v3.jinja", "gemma4_v4.jinja",
    "gemma4_v5.jinja", "glm4moe.jinja", "gptoss.jinja", "lfm2_2_5.jinja", "lfm2_2_5_v2.jinja",
    "lfm2_2_5_vl.jinja", "lfm2_v2.jinja", "llama3_1.jinja", "llama3_2.jinja", "nemotron_3_5_lightning.jinja",
    "nemotron_3_nano.jinja", "nemotron_3_super.jinja", "nemotron_3_ultra.jinja", "qwen2_5.jinja",
    "qwen2_5_vl.jinja", "qwen3.jinja", "qwen3_5_nothink.jinja", "qwen3_5_think.jinja", "qwen3_6.jinja",
    "qwen3_8.jinja", "qwen3_instruct_2507.jinja", "qwen3_vl.jinja",
}  # fmt: skip


def test_every_shipped_template_is_served_or_refused_with_a_reason(base_tokenizer):
    served, refused = set(), {}
    for file in shipped_template_files():
        text = shipped_template_text(file)
        tokenizer = copy.deepcopy(base_tokenizer)
        # (Llama 3.2's template never writes <|eom_id|>, which its tokenizer has and Llama stops on.)
        markup = sorted(set(_MARKUP_TOKEN.findall(text)) | ({"<|eom_id|>"} if "llama3" in file else set()))
        tokenizer.add_special_tokens({"additional_special_tokens": markup})
        tokenizer.chat_template = text
        try:
            make_codec(tokenizer)  # the self-check included: a codec returned passed every probe
            served.add(file)
        except UnsupportedChatTemplateError as exc:
            refused[file] = str(exc)
    assert served == SERVED
    # Refusals say why: the form the template writes, or that it writes no tool calls.
    assert (
        "writes tool calls as" in refused["deepseekv3.jinja"]
        and "Known families" in refused["deepseekv3.jinja"]
    )
    assert "writes tool calls as" in refused["muse_glimmer.jinja"]
    assert "neither renders assistant tool calls" in refused["llama3.jinja"]
