"""Which reply format a chat template writes, found by rendering a probe through it.

The template is asked to render one assistant turn that calls ``lookup(key="probe-value")``, and
each known format says whether that text is in its form. Nothing compares template *text*: a
fork, a revision or a fine-tune's copy of a template is recognised as long as it writes calls
the same way, and a template that writes them some other way is refused with what it wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from cookbook_lib.codecs.gemma4 import Gemma4Format
from cookbook_lib.codecs.glm import GLMFormat
from cookbook_lib.codecs.harmony import HarmonyFormat
from cookbook_lib.codecs.hermes import HermesFormat
from cookbook_lib.codecs.llama3 import Llama3JSONFormat
from cookbook_lib.codecs.pythonic import PythonicFormat
from cookbook_lib.codecs.qwen_xml import QwenXMLFormat
from cookbook_lib.codecs.reply import THINK_TAGS, ReplyFormat
from cookbook_lib.types import ToolSpec

# Most specific first: Qwen3.5's XML and GLM's blocks also open with <tool_call>.
FORMATS: tuple[type[ReplyFormat], ...] = (
    QwenXMLFormat,
    GLMFormat,
    HermesFormat,
    Llama3JSONFormat,
    HarmonyFormat,
    Gemma4Format,
    PythonicFormat,
)

PROBE_QUESTION = "cookbook-probe-question"
PROBE_VALUE = "probe-value"
PROBE_REASONING = "cookbook-probe-reasoning"
PROBE_TOOL = ToolSpec(
    type="function",
    function={
        "name": "lookup",
        "description": "Look up the value of a fact.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
)

# (messages, tool specs, add_generation_prompt) -> rendered text
Render = Callable[[Sequence[dict[str, Any]], Sequence[ToolSpec], bool], str]


class TemplateProbeError(ValueError):
    """The template failed to render a probe; the message says which and why."""


def known_families() -> str:
    """Every family the codecs serve, for messages and docs."""
    rendered = [f"{fmt.families} ({fmt.name})" for fmt in FORMATS]
    return "; ".join([*rendered, "Mistral through mistral-common's tokenizers (mistral)"])


def rendered_call(render: Render) -> str | None:
    """What the template writes for an assistant turn calling the probe tool (after its
    generation prompt), or None when the template does not write tool calls at all."""
    question = [{"role": "user", "content": PROBE_QUESTION}]
    call = {
        "id": "call_probe",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"key": PROBE_VALUE}},
    }
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    try:
        prompt = render(question, [PROBE_TOOL], True)
        full = render([*question, reply], [PROBE_TOOL], False)
    except Exception as exc:
        # Some templates (DeepSeek-V3's) take the arguments as a JSON string, not an object: say
        # what they write, which no format here reads, rather than that they fail.
        as_text = {**call, "function": {"name": "lookup", "arguments": json.dumps({"key": PROBE_VALUE})}}
        try:
            prompt = render(question, [PROBE_TOOL], True)
            full = render([*question, {**reply, "tool_calls": [as_text]}], [PROBE_TOOL], False)
        except Exception:
            raise TemplateProbeError(
                f"the chat template fails to render an assistant tool call: {exc!r}"
            ) from None
    written = full[len(prompt) :] if full.startswith(prompt) else full
    return written if PROBE_VALUE in written else None


def reply_format_for(written: str, render: Render) -> ReplyFormat | None:
    """The format whose form ``written`` is in, configured for the template, or None."""
    for format_class in FORMATS:
        if format_class.writes(written):
            if format_class is HermesFormat:
                return HermesFormat(THINK_TAGS if renders_think(render) else None)
            if format_class is QwenXMLFormat:
                return QwenXMLFormat(reasoning=renders_think(render))
            if format_class is PythonicFormat:
                return PythonicFormat(reasoning=renders_think(render))
            return format_class()
    return None


def renders_think(render: Render) -> bool:
    """Whether the template writes ``<think>`` blocks into assistant turns: around a reply's
    reasoning, as an empty block in a plain reply, or in its generation prompt."""
    question = [{"role": "user", "content": PROBE_QUESTION}]
    reasoned = {"role": "assistant", "content": "answer", "reasoning_content": PROBE_REASONING}
    plain = {"role": "assistant", "content": "answer"}
    try:
        header = render(question, [], False)
        texts = [
            render(question, [], True),
            render([*question, reasoned], [], False),
            render([*question, plain], [], False),
        ]
    except Exception:
        return False
    return any(THINK_TAGS.open in text.removeprefix(header) for text in texts)
