"""Seeing episodes: a conversation as chat bubbles, tokens coloured by the training mask, a widget.

Reading episodes is how one finds out what a model actually does (and why a reward is what it is),
so these builders show everything an :class:`~cookbook_lib.rollout.episode.Episode` records: the messages
with their tool calls and tool errors, how the episode ended, its metrics, and, token by token,
what training will and will not learn from.

Everything shown is escaped: model output is untrusted, and ``<script>`` in a reply must show up
as text, not run in the notebook. Styles are inline so the HTML looks the same in JupyterLab,
VS Code and a widget, with no stylesheet to load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape

import ipywidgets as widgets
from transformers import PreTrainedTokenizerBase

from cookbook_lib.display.plots import END_CAUSE_COLORS
from cookbook_lib.envs import TOOL_ERROR_PREFIX
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.types import Message

SAMPLED_COLOR = "#c6efce"  # tokens the model sampled: they carry log-probs and are trained
PROMPT_COLOR = "#e8e8e8"  # prompt, tool results, turn closings: context only, never trained
TOOL_ERROR_COLOR = "#fde2e1"

END_CAUSE_NOTES: dict[EndCause, str] = {
    EndCause.TERMINATED: "the environment ended the episode (task logic); the reward is the env's.",
    EndCause.CONTEXT_OVERFLOW: "truncated: the conversation filled max_model_length. "
    "The soft overlong penalty applies.",
    EndCause.MAX_TURNS: "truncated: max_turns reached without terminating. "
    "The soft overlong penalty applies.",
    EndCause.ENV: "truncated by the environment (step returned truncated=True). No overlong penalty.",
    EndCause.PARSE_FAILURE: "truncated: the last reply could not be parsed; the reward is "
    "failed_parse_reward. No overlong penalty.",
    EndCause.ERROR: "an exception escaped the environment; never trained on.",
}

_ROLE_STYLES: dict[str, str] = {
    "system": "background:#f4f4f4;border-left:4px solid #999",
    "user": "background:#e8f0fe;border-left:4px solid #4285f4",
    "assistant": "background:#eaf7ea;border-left:4px solid #2ca02c;margin-left:24px",
    "tool": "background:#fff8e1;border-left:4px solid #f2b134;margin-left:48px",
}
_PRE = "white-space:pre-wrap;word-break:break-word;margin:4px 0;font-family:ui-monospace,monospace"
_BOX = "font-family:system-ui,sans-serif;font-size:13px;line-height:1.45;max-width:960px"


def _pretty_arguments(arguments: str) -> str:
    """Tool-call arguments as indented JSON; as written (flagged) when they are not valid JSON."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return f"{arguments}\n(not valid JSON)"


def _message_html(message: Message, note: str = "") -> str:
    role = str(message.get("role", "?"))
    content = str(message.get("content") or "")
    style = _ROLE_STYLES.get(role, _ROLE_STYLES["system"])
    label = escape(role)
    if role == "tool":
        name, call_id = str(message.get("name", "")), str(message.get("tool_call_id", ""))
        label += f" · {escape(name)} · answer to {escape(call_id)}"
        if content.startswith(TOOL_ERROR_PREFIX):
            style = f"background:{TOOL_ERROR_COLOR};border-left:4px solid #d62728;margin-left:48px"
            label += ' · <b style="color:#d62728">tool_error</b>'
    if note:
        label += f' · <i style="color:#d62728">{escape(note)}</i>'
    parts = [f'<div class="msg msg-{escape(role)}" style="padding:6px 10px;margin:6px 0;{style}">']
    parts.append(f'<div style="font-size:11px;color:#555">{label}</div>')
    reasoning = message.get("reasoning_content")
    if reasoning:
        # Sampled and trained like the answer, but not what the env scores: folded away.
        parts.append(
            f'<details class="reasoning"><summary style="font-size:11px;color:#777">reasoning</summary>'
            f'<pre style="{_PRE};color:#666">{escape(str(reasoning))}</pre></details>'
        )
    calls = message.get("tool_calls") or []
    if content or not calls:
        parts.append(f'<pre style="{_PRE}">{escape(content) if content else "<i>(empty reply)</i>"}</pre>')
    for call in calls:
        function = call.get("function") or {}
        name, call_id = escape(str(function.get("name", ""))), escape(str(call.get("id", "")))
        arguments = escape(_pretty_arguments(str(function.get("arguments", ""))))
        parts.append(
            f'<div class="tool-call" style="margin-top:4px">&#8594; calls <b>{name}</b> '
            f'<span style="color:#777">({call_id})</span><pre style="{_PRE};background:#fff;'
            f'padding:4px">{arguments}</pre></div>'
        )
    parts.append("</div>")
    return "".join(parts)


def _end_cause_badge(cause: EndCause) -> str:
    return (
        f'<span style="background:{END_CAUSE_COLORS[cause]};color:#fff;padding:1px 6px;'
        f'border-radius:3px;font-weight:600">{escape(cause.value)}</span>'
    )


def episode_html(episode: Episode) -> str:
    """One episode as HTML: a header (task, reward, end cause, turns, metrics, error) and its messages.

    The last reply of a PARSE_FAILURE episode is marked: it is kept in the record so one can see
    what the model wrote, but it was never sent to the environment.
    """
    cause = episode.end_cause
    metrics = " · ".join(f"{escape(str(key))}={value:g}" for key, value in episode.metrics.items())
    header = [
        f"<div><b>Task:</b> {escape(episode.task.prompt)} <span style='color:#777'>"
        f"(target {escape(str(episode.task.target))})</span></div>",
        f"<div><b>reward {episode.reward:g}</b> · {_end_cause_badge(cause)} · {episode.num_turns} "
        f"assistant turn{'s' if episode.num_turns != 1 else ''} · {episode.wall_time_s:.1f} s</div>",
        f'<div style="color:#555">{escape(END_CAUSE_NOTES[cause])}</div>',
    ]
    if metrics:
        header.append(f'<div style="color:#555">metrics: {metrics}</div>')
    if episode.error:
        header.append(
            f'<pre class="episode-error" style="{_PRE};background:{TOOL_ERROR_COLOR};padding:6px">'
            f"{escape(episode.error)}</pre>"
        )
    last = len(episode.messages) - 1
    bubbles = [
        _message_html(
            message,
            "could not be parsed: never sent to the environment"
            if cause is EndCause.PARSE_FAILURE and index == last and message.get("role") == "assistant"
            else "",
        )
        for index, message in enumerate(episode.messages)
    ]
    return (
        f'<div class="episode" style="{_BOX}"><div style="border-bottom:1px solid #ccc;padding-bottom:6px">'
        + "".join(header)
        + "</div>"
        + "".join(bubbles)
        + "</div>"
    )


def _token_span(text: str, token: int, trained: bool, logprob: float, version: int) -> str:
    shown = escape(text.replace("\n", "\u21b5\n"))  # keep line breaks, and make them visible
    if trained:
        title = f"id {token} · sampling logprob {logprob:.3f} · policy v{version}"
        return (
            f'<span class="tok tok-sampled" style="background:{SAMPLED_COLOR}" title="{title}">{shown}</span>'
        )
    title = f"id {token} · prompt / environment token, not trained"
    return f'<span class="tok tok-prompt" style="background:{PROMPT_COLOR}" title="{title}">{shown}</span>'


def tokens_html(episode: Episode, tokenizer: PreTrainedTokenizerBase) -> str:
    """Every token of every training sequence of ``episode``, coloured by the training mask.

    Sampled tokens (trained on, hover shows id, sampling log-prob and policy version) are green;
    prompt, tool-result and turn-closing tokens (context only) are grey. An episode whose chat
    template rewrote the history has several sequences; each starts under its own heading, because
    each becomes a separate training sample. Tokens are decoded one by one, so a character split
    over two tokens shows as two replacement characters.
    """
    sequences = episode.token_sequences()
    if not sequences:
        return (
            f'<div style="{_BOX};color:#555">No tokens: this episode was played by a scripted policy '
            "(or ended before the model sampled anything), so there is nothing to train on.</div>"
        )
    legend = (
        f'<div style="margin-bottom:6px"><span style="background:{SAMPLED_COLOR};padding:0 4px">sampled: '
        f'trained on</span> <span style="background:{PROMPT_COLOR};padding:0 4px">prompt, tool results, '
        "turn closings: not trained</span> <span style='color:#777'>(hover a token for its id and "
        "log-prob)</span></div>"
    )
    parts = [f'<div class="tokens" style="{_BOX}">', legend]
    for number, sequence in enumerate(sequences, start=1):
        trained = sum(sequence.assistant_mask_T)
        heading = f"{len(sequence)} tokens, {trained} sampled and trained"
        if len(sequences) > 1:
            heading = f"Sequence {number} of {len(sequences)} (a separate training sample): {heading}"
        parts.append(
            f'<div class="sequence" style="border-top:2px solid #999;margin-top:8px;padding-top:4px">'
            f'<div style="font-size:11px;color:#555">{escape(heading)}</div><div style="{_PRE}">'
        )
        texts = tokenizer.batch_decode(
            [[token] for token in sequence.tokens_T],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        parts += [
            _token_span(text, token, mask, logprob, version)
            for text, token, mask, logprob, version in zip(
                texts,
                sequence.tokens_T,
                sequence.assistant_mask_T,
                sequence.sampling_logprobs_T,
                sequence.policy_versions_T,
                strict=True,
            )
        ]
        parts.append("</div></div>")
    parts.append("</div>")
    return "".join(parts)


def side_by_side_html(texts: Mapping[str, str]) -> str:
    """Texts in columns under their titles (e.g. one conversation as two chat templates write it)."""
    columns = "".join(
        f'<div style="flex:1;min-width:0"><b>{escape(title)}</b><pre style="{_PRE};background:#f6f6f6;'
        f'padding:6px;font-size:11px">{escape(text)}</pre></div>'
        for title, text in texts.items()
    )
    return f'<div class="side-by-side" style="display:flex;gap:12px">{columns}</div>'


def episode_label(index: int, episode: Episode) -> str:
    """The short line naming an episode in a picker: index, reward, end cause, task."""
    prompt = episode.task.prompt if len(episode.task.prompt) <= 40 else episode.task.prompt[:39] + "\u2026"
    return f"#{index} · reward {episode.reward:g} · {episode.end_cause.value} · {prompt}"


class EpisodeViewer(widgets.VBox):
    """Pick an episode (dropdown or previous/next), see its messages and, given a tokenizer, its tokens.

    Display it as the last expression of a cell. ``select(i)`` does what the dropdown does, so a
    notebook (or a test) can drive it from code.
    """

    def __init__(self, episodes: Sequence[Episode], tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        if not episodes:
            raise ValueError("EpisodeViewer needs at least one episode")
        self.episodes = list(episodes)
        self.tokenizer = tokenizer
        self.selector = widgets.Dropdown(
            options=[(episode_label(i, e), i) for i, e in enumerate(self.episodes)],
            value=0,
            description="Episode",
            layout=widgets.Layout(width="70%"),
        )
        self.previous_button = widgets.Button(description="\u25c0", layout=widgets.Layout(width="40px"))
        self.next_button = widgets.Button(description="\u25b6", layout=widgets.Layout(width="40px"))
        self.messages_pane = widgets.HTML()
        self.tokens_pane = widgets.HTML()
        self.selector.observe(lambda change: self._show(change["new"]), names="value")
        self.previous_button.on_click(lambda _: self.select(self.index - 1))
        self.next_button.on_click(lambda _: self.select(self.index + 1))
        body: widgets.Widget = self.messages_pane
        if tokenizer is not None:
            body = widgets.Tab(children=[self.messages_pane, self.tokens_pane], titles=("Messages", "Tokens"))
        self._show(0)
        super().__init__(
            children=[widgets.HBox([self.selector, self.previous_button, self.next_button]), body]
        )

    @property
    def index(self) -> int:
        return int(self.selector.value)

    def select(self, index: int) -> None:
        """Show episode ``index`` (wraps around, so "next" on the last episode shows the first)."""
        self.selector.value = index % len(self.episodes)

    def _show(self, index: int) -> None:
        episode = self.episodes[index]
        self.messages_pane.value = episode_html(episode)
        if self.tokenizer is not None:
            self.tokens_pane.value = tokens_html(episode, self.tokenizer)


def episodes_table_html(episodes: Sequence[Episode], labels: Sequence[str] | None = None) -> str:
    """A table with one row per episode: what ended it, whether that is a truncation, whether the
    overlong penalty applies, whether training builds samples from it by default and with
    ``overlong_masking=True`` (which drops every truncation), and the reward.

    Made for comparing episodes that ended differently (the truncation demo in notebook 02).
    """
    if labels is not None and len(labels) != len(episodes):
        raise ValueError(f"{len(labels)} labels for {len(episodes)} episodes")
    names = labels if labels is not None else [f"#{i}" for i in range(len(episodes))]
    head = [
        "episode",
        "end cause",
        "truncation",
        "overlong penalty",
        "trained",
        "with overlong_masking",
        "reward",
    ]
    cell = 'style="border:1px solid #ccc;padding:3px 8px;text-align:left"'
    rows = ["<tr>" + "".join(f"<th {cell}>{escape(h)}</th>" for h in head) + "</tr>"]
    for name, episode in zip(names, episodes, strict=True):
        cause = episode.end_cause
        values = [
            escape(name),
            _end_cause_badge(cause),
            "yes" if cause.is_truncation else "no",
            "yes" if cause.is_overlong else "no",
            "no" if cause is EndCause.ERROR else "yes",
            "yes" if cause is EndCause.TERMINATED else "no",
            f"{episode.reward:g}",
        ]
        rows.append("<tr>" + "".join(f"<td {cell}>{value}</td>" for value in values) + "</tr>")
    return f'<table style="border-collapse:collapse;{_BOX}">' + "".join(rows) + "</table>"
