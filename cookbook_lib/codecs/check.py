"""The template self-check: before the first rollout, on the tokenizer alone (no model loaded),
render and parse the shapes a tool-use episode needs, and refuse the run if one fails.

Probes, each rendered through the codec and parsed back as a model's sampled tokens would be:

- ``one call``: a reply calling one tool gives that call back, and no content;
- ``parallel calls``: two calls in one reply (skipped where the template renders one per turn);
- ``consecutive tool messages``: two tool results in a row render after the calls, and the
  continuation after the reply equals the template's full render, token for token;
- ``reasoning``: a reply with reasoning gives the reasoning back apart from the answer (skipped
  where the format has no reasoning);
- ``plain answer``: a final answer parses to exactly its text (no reasoning markup left in it);
- ``continuation``: a two-turn episode (call, result, answer) built token by token as a rollout
  builds it equals the template's full render wherever the codec does not restart.

``python -m cookbook_lib.codecs.check MODEL_OR_FOLDER`` runs it alone and prints each probe.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from cookbook_lib.codecs.base import Codec, UnsupportedChatTemplateError
from cookbook_lib.types import Message, ToolSpec, make_tool_call

ProbeStatus = Literal["ok", "skipped", "failed"]

LOOKUP = ToolSpec(
    type="function",
    function={
        "name": "lookup",
        "description": "Look up the value of a fact.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}, "count": {"type": "integer"}},
            "required": ["key"],
        },
    },
)
SPECS = [LOOKUP]
_OPENING = [
    Message(role="system", content="You answer with the tool's help."),
    Message(role="user", content="What is the value of alpha?"),
]


class ChatTemplateCheckError(UnsupportedChatTemplateError):
    """A template failed a self-check probe; the message names the probe and what went wrong."""


@dataclass(frozen=True)
class ProbeResult:
    name: str
    status: ProbeStatus
    detail: str = ""


@dataclass
class CheckReport:
    """What each probe found. ``restarts`` counts the probes' continuations that restarted."""

    codec: str
    probes: list[ProbeResult] = field(default_factory=list)
    restarts: int = 0
    notes: set[str] = field(default_factory=set)

    @property
    def failed(self) -> list[ProbeResult]:
        return [probe for probe in self.probes if probe.status == "failed"]

    def raise_for_failure(self) -> None:
        if self.failed:
            first = self.failed[0]
            raise ChatTemplateCheckError(
                f"the chat template failed the self-check probe {first.name!r} ({self.codec}): "
                f"{first.detail}. "
                "Run `python -m cookbook_lib.codecs.check MODEL` for every probe"
            )

    def lines(self) -> list[str]:
        rows = [
            f"{probe.status:>7}  {probe.name}" + (f": {probe.detail}" if probe.detail else "")
            for probe in self.probes
        ]
        if self.restarts:
            rows.append(
                f"   note  the template rewrites history: {self.restarts} continuation(s) restarted a sample"
            )
        rows += [f"   note  {note}" for note in sorted(self.notes)]
        return rows


class _ProbeFailure(Exception):
    pass


def check_codec(codec: Codec) -> CheckReport:
    """Run every probe on ``codec``. A failing probe is reported, never raised (see
    :meth:`CheckReport.raise_for_failure`)."""
    report = CheckReport(codec=f"{type(codec).__name__}, {codec.reply_format.name} format")
    probes = (
        ("one call", _one_call),
        ("parallel calls", _parallel_calls),
        ("consecutive tool messages", _consecutive_tool_messages),
        ("reasoning", _reasoning),
        ("plain answer", _plain_answer),
        ("continuation", _continuation),
    )
    for name, probe in probes:
        try:
            detail = probe(codec, report)
            status: ProbeStatus = "skipped" if detail.startswith("skipped") else "ok"
            report.probes.append(ProbeResult(name, status, detail.removeprefix("skipped: ")))
        except _ProbeFailure as exc:
            report.probes.append(ProbeResult(name, "failed", str(exc)))
        except Exception as exc:
            report.probes.append(ProbeResult(name, "failed", f"{type(exc).__name__}: {exc}"))
    return report


def _call(key: str, count: int | None = None) -> dict[str, object]:
    return {"key": key} if count is None else {"key": key, "count": count}


def _reply(content: str, *arguments: dict[str, object], reasoning: str | None = None) -> Message:
    message = Message(role="assistant", content=content)
    if arguments:
        message["tool_calls"] = [
            make_tool_call(f"probe_{i}", "lookup", args) for i, args in enumerate(arguments)
        ]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _round_trip(codec: Codec, message: Message) -> tuple[list[int], Message]:
    """``message`` rendered as the tokens a model would sample, then parsed back."""
    sampled = codec.render_assistant(message)
    if not sampled or sampled[-1] not in codec.stop_token_ids:
        raise _ProbeFailure(
            f"the rendered reply does not end with a stop token: {codec.tokenizer.decode(sampled)!r}"
        )
    parsed = codec.parse(sampled, SPECS)
    if parsed.message is None:
        raise _ProbeFailure(
            f"the template's own rendering does not parse: {parsed.error} (text {parsed.text!r})"
        )
    return sampled, parsed.message


def _calls(message: Message) -> list[tuple[str, object]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ]


def _expect_calls(parsed: Message, expected: Message) -> None:
    if _calls(parsed) != _calls(expected):
        raise _ProbeFailure(f"calls {_calls(expected)} parsed back as {_calls(parsed)}")
    if parsed["content"] != expected["content"]:
        raise _ProbeFailure(f"content {expected['content']!r} parsed back as {parsed['content']!r}")


def _one_call(codec: Codec, report: CheckReport) -> str:
    message = _reply("", _call("alpha", 3))
    _, parsed = _round_trip(codec, message)
    _expect_calls(parsed, message)
    return ""


def _parallel_calls(codec: Codec, report: CheckReport) -> str:
    limit = codec.reply_format.max_calls
    if limit is not None and limit < 2:
        return f"skipped: the template renders at most {limit} call per turn"
    message = _reply("", _call("alpha"), _call("beta", 2))
    _, parsed = _round_trip(codec, message)
    _expect_calls(parsed, message)
    return ""


def _consecutive_tool_messages(codec: Codec, report: CheckReport) -> str:
    two = codec.reply_format.max_calls is None or codec.reply_format.max_calls >= 2
    message = _reply("", _call("alpha"), _call("beta")) if two else _reply("", _call("alpha"))
    results = ["result-one-17", "result-two-25"]
    _episode(codec, report, [(message, results)])
    return "" if two else "one call, then two tool messages (the template renders one call per turn)"


def _reasoning(codec: Codec, report: CheckReport) -> str:
    if not codec.reply_format.has_reasoning:
        return "skipped: this format has no reasoning"
    if codec.prompt_closes_reasoning:
        return "skipped: the generation prompt closes the reasoning block (thinking is off)"
    message = _reply("The answer is 42.", reasoning="Six times seven is 42.")
    sampled, parsed = _round_trip(codec, message)
    note = ""
    tags = codec.reply_format.reasoning_tags
    if parsed.get("reasoning_content") is None and tags is not None:
        # The template drops reasoning from a final turn (Gemma 4's and LFM2's earlier revisions):
        # parse the block as a model writes it, in the format's own markup, before that answer.
        opening = "" if codec.prompt_opens_reasoning else f"{tags.open}\n"
        block = codec.tokenizer.encode(
            f"{opening}{message['reasoning_content']}\n{tags.close}", add_special_tokens=False
        )
        result = codec.parse([*block, *sampled], SPECS)
        if result.message is None:
            raise _ProbeFailure(f"a reasoning block does not parse: {result.error} (text {result.text!r})")
        parsed = result.message
        note = (
            "the template does not render reasoning in a final turn; a reasoning block in its markup parsed"
        )
    if (
        parsed.get("reasoning_content") != message["reasoning_content"]
        or parsed["content"] != message["content"]
    ):
        raise _ProbeFailure(
            f"reasoning {message['reasoning_content']!r} and answer {message['content']!r} parsed back as "
            f"{parsed.get('reasoning_content')!r} and {parsed['content']!r}"
        )
    return note


def _plain_answer(codec: Codec, report: CheckReport) -> str:
    message = _reply("42")
    _, parsed = _round_trip(codec, message)
    if parsed["content"] != "42" or parsed.get("tool_calls"):
        raise _ProbeFailure(f"the answer '42' parsed back as content {parsed['content']!r}")
    return ""


def _continuation(codec: Codec, report: CheckReport) -> str:
    first = _reply("", _call("alpha"), reasoning="I need alpha." if codec.can_reason else None)
    _episode(codec, report, [(first, ["17"]), (_reply("The value is 17."), [])])
    return ""


def _episode(codec: Codec, report: CheckReport, turns: Sequence[tuple[Message, Sequence[str]]]) -> None:
    """Play ``turns`` (a reply, then the tool results after it) as a rollout does and compare each
    next prompt with the template's full render of the conversation so far."""
    messages: list[Message] = list(_OPENING)
    prompt = codec.render_prompt(messages, SPECS)
    for reply, results in turns:
        # The conversation's text before this reply's turn header, which no continuation changes.
        before_reply = _decode(codec, codec.render_prompt(messages, SPECS))
        before_reply = before_reply[: len(before_reply) - 40]
        sampled, parsed = _round_trip(codec, reply)
        _expect_calls(parsed, reply)
        messages.append(parsed)
        if not results:
            return
        ids = [call["id"] for call in parsed.get("tool_calls", [])]
        new = [
            Message(
                role="tool",
                content=text,
                name="lookup",
                tool_call_id=ids[min(i, len(ids) - 1)] if ids else "x",
            )
            for i, text in enumerate(results)
        ]
        continuation = codec.render_continuation(messages, sampled, new, SPECS)
        messages += new
        full = codec.render_prompt(messages, SPECS)
        if continuation.restarted:
            report.restarts += 1
            prompt = continuation.tokens
        else:
            prompt = prompt + sampled + codec.close_turn(sampled) + continuation.tokens
        # Text, not tokens: where a reply meets its prompt the tokens are split as sampled ("\\n" +
        # "\\n</think>"), not as a whole render would merge them. What the codec rendered itself,
        # the continuation, must be the template's own tokens.
        built_text, text = _decode(codec, prompt), _decode(codec, full)
        if full[len(full) - len(continuation.tokens) :] != continuation.tokens:
            raise _ProbeFailure("the continuation's tokens are not the template's tokens for that text")
        if built_text != text:
            # Acceptable only inside the reply: a template may show history with other whitespace
            # than its generation prompt gave the model (Nemotron's "<think>\\n"); the model's own
            # tokens stay, and everything after the reply must be the template's.
            after_reply = _decode(codec, [*codec.close_turn(sampled), *continuation.tokens])
            if not (
                text.endswith(after_reply)
                and built_text.endswith(after_reply)
                and text.startswith(before_reply)
            ):
                raise _ProbeFailure(
                    "the prompt built turn by turn differs from the template's render of the conversation:\n"
                    f"  built:    {built_text[-300:]!r}\n  template: {text[-300:]!r}"
                )
            report.notes.add(
                "the template renders a reply in history with other whitespace than the model wrote it"
            )
        missing = [result for result in results if result not in text]
        if missing:
            raise _ProbeFailure(f"the tool results {missing} are not in the rendered conversation")


def _decode(codec: Codec, tokens: Sequence[int]) -> str:
    return codec.tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def main(argv: Sequence[str] | None = None) -> int:
    from cookbook_lib.codecs import make_codec
    from cookbook_lib.codecs.reference import REFERENCE_TEMPLATES, reference_tokenizer
    from cookbook_lib.runtime.models import load_tokenizer

    parser = argparse.ArgumentParser(
        prog="python -m cookbook_lib.codecs.check",
        description="Check that a model's chat template renders and parses tool-use episodes exactly.",
    )
    parser.add_argument(
        "model", nargs="?", help="a model name or folder (its tokenizer is loaded, no weights)"
    )
    parser.add_argument(
        "--reference",
        choices=sorted(REFERENCE_TEMPLATES),
        help="check a shipped template on the embedded tokenizer",
    )
    thinking = parser.add_mutually_exclusive_group()
    thinking.add_argument("--thinking", dest="enable_thinking", action="store_true", default=None)
    thinking.add_argument("--no-thinking", dest="enable_thinking", action="store_false")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.reference is None):
        parser.error("give a MODEL or --reference NAME")
    tokenizer = reference_tokenizer(args.reference) if args.reference else load_tokenizer(args.model)
    try:
        codec = make_codec(tokenizer, enable_thinking=args.enable_thinking, check=False)
    except (UnsupportedChatTemplateError, ValueError) as exc:
        print(f"refused: {exc}")
        return 1
    report = check_codec(codec)
    print(f"{args.model or args.reference}: {report.codec}")
    print("\n".join(report.lines()))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
