"""The codec interface: a conversation to token ids, and sampled tokens back to an assistant Message.

Token-exact multi-turn. The tokens trained on must be the tokens the model sampled, under the
log-probabilities it sampled them with. Decoding a reply and encoding the text again does not give
them back (a model may sample " ans" + "wer" where the tokenizer writes " answer"), so a rollout
never re-renders what the model wrote. It builds the next prompt as::

    next_prompt = prompt + sampled + codec.close_turn(sampled)
                  + codec.render_continuation(history, sampled, new_messages, tool_specs).tokens

``close_turn`` adds what a full render puts after an assistant reply that sampling did not produce
(for ChatML ``"<|im_end|>"`` unless the model sampled it, then ``"\\n"``); ``render_continuation``
renders the messages the environment appended (tool results, a user message) and the generation
prompt. For a conversation whose replies are written canonically this equals
``render_prompt(history + new_messages, tool_specs)``, token for token; the tests check it.

History rewrites. Some chat templates render earlier turns differently once more messages follow:
Qwen3's drops the ``<think>`` block of assistant turns before the last user query. Then no suffix
continues what the model saw into what the template would show it, and the codec says so:
``Continuation.restarted`` is True and ``tokens`` is a full fresh prompt. The rollout starts a new
training sample there instead of training on a sequence the model was never shown.

Parsing is the reply format's (see :mod:`cookbook_lib.codecs.reply`): one per model family.
"""

from __future__ import annotations

import abc
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs.reply import ParsedReply, ReplyFormat, ToolCallFormatError, check_call_count
from cookbook_lib.types import Message, ToolSpec, make_tool_call

logger = logging.getLogger(__name__)


class UnsupportedChatTemplateError(ValueError):
    """The tokenizer's chat template is not one a codec here can render or parse."""


@dataclass(frozen=True)
class ParseResult:
    """A sampled reply, read back. ``message`` is None exactly when ``error`` says why.

    ``text`` is the decoded reply (special tokens kept, the final stop token left out), so an
    unparsable reply can still be shown and recorded.
    """

    message: Message | None
    error: str | None
    text: str

    @property
    def ok(self) -> bool:
        return self.message is not None


@dataclass(frozen=True)
class Continuation:
    """What comes after a closed assistant turn.

    ``restarted=False``: ``tokens`` extend the sequence so far (prompt + sampled + close_turn).
    ``restarted=True``: the template rewrote earlier turns; ``tokens`` are a full fresh prompt for
    the whole conversation, to be used instead of the sequence so far (a new training sample).
    """

    tokens: list[int]
    restarted: bool = False


class Codec(abc.ABC):
    """Renders conversations for one tokenizer and parses what its model samples.

    Subclasses say how a turn ends (``turn_closing``: the text a full render puts right after a
    plain assistant reply) and in which format replies are written (``reply_format``); from these
    the codec knows its end-of-turn token, its stop tokens and how to close a turn, so they cannot
    disagree. A format may add stops of its own (gpt-oss's ``<|call|>``), and a template may have
    no closing at all when the format's stops open the next turn (GLM).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, turn_closing: str, reply_format: ReplyFormat
    ) -> None:
        self.tokenizer = tokenizer
        self.reply_format = reply_format
        self._closing_ids = self._encode(turn_closing)
        self.extra_stop_ids: list[int] = [self._single_added_token(text) for text in reply_format.extra_stops]
        end_of_turn = self._closing_ids[0] if self._closing_ids else None
        if end_of_turn is not None and not self._is_added(end_of_turn):
            raise UnsupportedChatTemplateError(
                f"the chat template closes an assistant turn with {turn_closing!r}, which does not start "
                "with a single added token (like <|im_end|>) that sampling could stop on"
            )
        if end_of_turn is None and not (reply_format.stops_open_next_turn and self.extra_stop_ids):
            raise UnsupportedChatTemplateError(
                "the chat template writes nothing after an assistant reply, so no token could end a turn "
                f"(the {reply_format.name} format has no stop tokens of its own)"
            )
        self.end_of_turn_id: int | None = end_of_turn
        eos = tokenizer.eos_token_id
        # What ends an assistant turn when sampling: the end-of-turn token, the format's own stops,
        # and eos if different (base models trained on documents may end a reply with it).
        turn_stops = ([end_of_turn] if end_of_turn is not None else []) + self.extra_stop_ids
        self.stop_token_ids: list[int] = list(
            dict.fromkeys([*turn_stops, *([eos] if eos is not None else [])])
        )
        self._turn_stop_ids = frozenset(turn_stops)
        # Whether the generation prompt opens a reasoning block (Qwen3.6's ends with "<think>\n"):
        # the reply then starts inside it. Subclasses that render with a template find out.
        self.prompt_opens_reasoning = False
        # Whether it ends with an empty, closed block instead (thinking switched off).
        self.prompt_closes_reasoning = False
        self._call_numbers = itertools.count()

    @abc.abstractmethod
    def render_prompt(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> list[int]:
        """The whole conversation followed by the generation prompt (e.g. ``<|im_start|>assistant\\n``)."""

    @abc.abstractmethod
    def render_continuation(
        self,
        history: Sequence[Message],
        sampled_tokens: Sequence[int],
        new_messages: Sequence[Message],
        tool_specs: Sequence[ToolSpec],
    ) -> Continuation:
        """The tokens after a closed assistant turn, ending with the generation prompt.

        ``history`` is the conversation up to and including the assistant message parsed from
        ``sampled_tokens`` (as sent to the environment); ``new_messages`` are those the environment
        appended after it. ``sampled_tokens`` let a codec whose template rewrites history tell a
        real rewrite from a reply it merely writes differently while it is last.
        """

    @abc.abstractmethod
    def render_assistant(self, message: Message) -> list[int]:
        """The tokens a model would sample to write ``message``, ending with the end-of-turn token.

        What expert demonstrations are trained on, in the form :meth:`parse` reads back.
        """

    def close_turn(self, sampled_tokens: Sequence[int]) -> list[int]:
        """Tokens that close the assistant turn after ``sampled_tokens``, as a full render closes it.

        Not sampled, so not trained. When sampling stopped on the end-of-turn token the rest of the
        closing (``"\\n"`` for ChatML) is added; when it stopped on one of the format's own stops
        (``<|call|>``, ``<|observation|>``) that token closes the turn and nothing is added;
        otherwise (stopped by length, or by an eos that is not the end-of-turn token) the whole
        closing is.
        """
        last = sampled_tokens[-1] if sampled_tokens else None
        if last is not None and last == self.end_of_turn_id:
            return list(self._closing_ids[1:])
        if last is not None and last in self.extra_stop_ids:
            return []
        return list(self._closing_ids)

    @property
    def can_reason(self) -> bool:
        """Whether a reply can hold reasoning: the format reads it and the prompt does not close it."""
        return self.reply_format.has_reasoning and not self.prompt_closes_reasoning

    def stopped_on_turn_stop(self, sampled_tokens: Sequence[int]) -> bool:
        """Whether the reply ended with a token that ends a turn (not eos, not the length limit)."""
        return bool(sampled_tokens) and sampled_tokens[-1] in self._turn_stop_ids

    def parse(self, sampled_tokens: Sequence[int], tool_specs: Sequence[ToolSpec] = ()) -> ParseResult:
        """Read a sampled reply: an assistant Message with content, reasoning and tool calls.

        Reasoning (a ``<think>`` block, harmony's analysis channel, Gemma's thought channel) goes
        to ``reasoning_content``, so ``content`` holds only the answer. Tool calls get fresh ids
        ``call_<n>`` (unique for this codec) and their arguments as a JSON string; ``tool_specs``
        type the parameter values of formats that write them as text (Qwen3.5+'s XML, GLM). A
        reply without a tool call is a plain final answer. A malformed reply, or one the template
        could not render back, gives ``message=None`` and the reason in ``error``; the rollout
        ends the episode as PARSE_FAILURE.

        Never raises: sampled tokens are untrusted input, and one degenerate reply must end one
        episode, not the run. Arguments are plain JSON values (see :mod:`cookbook_lib.plain_json`);
        special tokens in the middle of a reply are kept in its text like any other token; a reply
        longer than :data:`reply.MAX_REPLY_CHARS` characters is a failure without being scanned.
        """
        tokens = list(sampled_tokens)
        if tokens and tokens[-1] in self.stop_token_ids:
            tokens.pop()
        try:
            text = self.decode_text(tokens)
        except Exception as exc:  # ids outside the vocabulary (negative, too large)
            return ParseResult(
                message=None, error=f"the sampled token ids cannot be decoded: {exc!r}", text=""
            )
        try:
            reply = self.reply_format.parse(text, tool_specs, in_reasoning=self.prompt_opens_reasoning)
            check_call_count(reply.calls, self.reply_format.max_calls, self.reply_format.families)
            arguments = [json.dumps(args, ensure_ascii=False, allow_nan=False) for _, args in reply.calls]
        except ToolCallFormatError as exc:
            return ParseResult(message=None, error=str(exc), text=text)
        except Exception as exc:
            # The parser's own bug, not the model's: still one failed reply, never a failed run.
            logger.exception("the reply parser raised on a sampled reply; it is counted as a parse failure")
            return ParseResult(message=None, error=f"the parser failed on this reply: {exc!r}", text=text)
        message = Message(role="assistant", content=reply.content)
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [
                make_tool_call(call_id, name, encoded)
                for call_id, (name, _), encoded in zip(
                    self.call_ids(reply), reply.calls, arguments, strict=True
                )
            ]
        refusal = self.unrenderable(message)
        if refusal is not None:
            return ParseResult(message=None, error=refusal, text=text)
        return ParseResult(message=message, error=None, text=text)

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """The text of sampled tokens, special tokens kept as the text they stand for."""
        # No "clean-up" of spaces: the text must be exactly what the tokens say (some saved
        # tokenizers ask for it; transformers then logs a warning for BPE and skips it anyway).
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def call_ids(self, reply: ParsedReply) -> list[str]:
        """Ids for a parsed reply's calls: fresh ``call_<n>``, unique for this codec. A format whose
        replies carry their own ids (Mistral's) keeps them."""
        return [f"call_{next(self._call_numbers)}" for _ in reply.calls]

    def unrenderable(self, message: Message) -> str | None:
        """Why the template cannot render ``message`` back, or None. Codecs that render with a
        template check; a reply it would refuse (Llama's two calls) is a parse failure, not an
        error in the next render."""
        return None

    def _is_added(self, token_id: int) -> bool:
        return self.tokenizer.convert_ids_to_tokens(token_id) in self.tokenizer.get_added_vocab()

    def _single_added_token(self, text: str) -> int:
        ids = self._encode(text)
        if len(ids) != 1 or not self._is_added(ids[0]):
            raise UnsupportedChatTemplateError(
                f"{text} is not a single added token in this tokenizer; the {self.reply_format.name} format "
                "stops on it"
            )
        return ids[0]

    def _encode(self, text: str) -> list[int]:
        # Chat templates write their own special tokens; the tokenizer must add none (no BOS).
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def check_history(history: Sequence[Message]) -> None:
    """``render_continuation`` continues after an assistant turn; anything else is a caller bug."""
    if not history or history[-1]["role"] != "assistant":
        last = history[-1]["role"] if history else "nothing"
        raise ValueError(f"history must end with the assistant message just sampled, not with {last}")
