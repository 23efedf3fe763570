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

Parsing reads the Hermes/Qwen tool-call form (see :mod:`cookbook_lib.codecs.hermes`).
"""

from __future__ import annotations

import abc
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from cookbook_lib.codecs import hermes
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

    Subclasses say how a turn ends (``turn_closing``: the text a full render puts right after an
    assistant reply); from it the codec knows its end-of-turn token, its stop tokens and how to
    close a turn, so these cannot disagree.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, turn_closing: str) -> None:
        self.tokenizer = tokenizer
        self._closing_ids = self._encode(turn_closing)
        end_of_turn = self._closing_ids[0] if self._closing_ids else None
        if (
            end_of_turn is None
            or tokenizer.convert_ids_to_tokens(end_of_turn) not in tokenizer.get_added_vocab()
        ):
            raise UnsupportedChatTemplateError(
                f"the chat template closes an assistant turn with {turn_closing!r}, which does not start "
                "with a single added token (like <|im_end|>) that sampling could stop on"
            )
        self.end_of_turn_id: int = end_of_turn
        eos = tokenizer.eos_token_id
        # What ends an assistant turn when sampling: the end-of-turn token, and eos if different
        # (base models trained on documents may end a reply with it).
        self.stop_token_ids: list[int] = [end_of_turn] + (
            [eos] if eos is not None and eos != end_of_turn else []
        )
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
        closing (``"\\n"`` for ChatML) is added; otherwise (stopped by length, or by an eos that is
        not the end-of-turn token) the whole closing is.
        """
        if sampled_tokens and sampled_tokens[-1] == self.end_of_turn_id:
            return list(self._closing_ids[1:])
        return list(self._closing_ids)

    def parse(self, sampled_tokens: Sequence[int]) -> ParseResult:
        """Read a sampled reply: an assistant Message with content and, if any, tool calls.

        Tool calls get fresh ids ``call_<n>`` (unique for this codec) and their arguments as a JSON
        string. A reply without ``<tool_call>`` is a plain final answer. Malformed tool calls give
        ``message=None`` and the reason in ``error``; the rollout ends the episode as PARSE_FAILURE.

        Never raises: sampled tokens are untrusted input, and one degenerate reply must end one
        episode, not the run. Arguments are plain JSON values (see :mod:`cookbook_lib.plain_json`);
        special tokens in the middle of a reply are kept in its text like any other token; a reply
        longer than :data:`hermes.MAX_REPLY_CHARS` characters is a failure without being scanned.
        """
        tokens = list(sampled_tokens)
        if tokens and tokens[-1] in self.stop_token_ids:
            tokens.pop()
        try:
            # No "clean-up" of spaces: the text must be exactly what the tokens say (some saved
            # tokenizers ask for it; transformers then logs a warning for BPE and skips it anyway).
            text = self.tokenizer.decode(
                tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        except Exception as exc:  # ids outside the vocabulary (negative, too large)
            return ParseResult(
                message=None, error=f"the sampled token ids cannot be decoded: {exc!r}", text=""
            )
        try:
            content, calls = hermes.split_reply(text)
            arguments = [json.dumps(args, ensure_ascii=False, allow_nan=False) for _, args in calls]
        except hermes.ToolCallFormatError as exc:
            return ParseResult(message=None, error=str(exc), text=text)
        except Exception as exc:
            # The parser's own bug, not the model's: still one failed reply, never a failed run.
            logger.exception("the reply parser raised on a sampled reply; it is counted as a parse failure")
            return ParseResult(message=None, error=f"the parser failed on this reply: {exc!r}", text=text)
        message = Message(role="assistant", content=content)
        if calls:
            message["tool_calls"] = [
                make_tool_call(f"call_{next(self._call_numbers)}", name, encoded)
                for (name, _), encoded in zip(calls, arguments, strict=True)
            ]
        return ParseResult(message=message, error=None, text=text)

    def _encode(self, text: str) -> list[int]:
        # Chat templates write their own special tokens; the tokenizer must add none (no BOS).
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def check_history(history: Sequence[Message]) -> None:
    """``render_continuation`` continues after an assistant turn; anything else is a caller bug."""
    if not history or history[-1]["role"] != "assistant":
        last = history[-1]["role"] if history else "nothing"
        raise ValueError(f"history must end with the assistant message just sampled, not with {last}")
