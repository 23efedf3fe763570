"""The episode viewer: escaped HTML, tokens coloured by the training mask, tool errors and
environment errors visible, and a widget whose selection drives its panes."""

from __future__ import annotations

import re

import ipywidgets as widgets
import pytest

from cookbook_lib.display.viewer import (
    PROMPT_COLOR,
    SAMPLED_COLOR,
    TOOL_ERROR_COLOR,
    EpisodeViewer,
    episode_html,
    episodes_table_html,
    tokens_html,
)
from cookbook_lib.envs import Task
from cookbook_lib.rollout.episode import EndCause, Episode, Turn
from cookbook_lib.types import Message, make_tool_call

HOSTILE = "<script>alert('x')</script>"
TASK = Task(prompt=f"What is a? {HOSTILE}", target=7)


def _tool_episode() -> Episode:
    """Two tool calls (one fails), a hostile final reply, and metrics."""
    messages = [
        Message(role="system", content="Use the tools."),
        Message(role="user", content=TASK.prompt),
        Message(
            role="assistant",
            content="Let me look <b>that</b> up.",
            tool_calls=[
                make_tool_call("call_0", "lookup", {"key": "a", "note": "<i>x</i>"}),
                make_tool_call("call_1", "calc<ulator>", '{"expression": "1 +'),
            ],
        ),
        Message(role="tool", content="7", tool_call_id="call_0", name="lookup"),
        Message(
            role="tool", content="tool_error: unknown tool 'calc<ulator>'", tool_call_id="call_1", name="x"
        ),
        Message(role="assistant", content=HOSTILE),
    ]
    return Episode(
        task=TASK,
        messages=messages,
        reward=0.0,
        end_cause=EndCause.TERMINATED,
        metrics={"tool_calls": 2.0, "tool_errors": 1.0},
        num_turns=2,
    )


def _tool_bubbles(html: str) -> list[str]:
    return [piece.split('<div class="msg')[0] for piece in html.split('<div class="msg msg-tool"')[1:]]


def test_episode_html_escapes_everything_the_model_or_task_wrote():
    html = episode_html(_tool_episode())
    for raw in ("<script>", "<b>that</b>", "<i>x</i>", "calc<ulator>"):
        assert raw not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "Let me look &lt;b&gt;that&lt;/b&gt; up." in html
    assert "calc&lt;ulator&gt;" in html


def test_episode_html_shows_the_header_and_pretty_tool_calls():
    html = episode_html(_tool_episode())
    assert "reward 0</b>" in html and "TERMINATED" in html and "2 assistant turns" in html
    assert "tool_calls=2" in html and "tool_errors=1" in html
    assert "(target 7)" in html
    # Valid arguments are indented JSON; broken ones are shown as written and flagged.
    assert (
        "{\n  &quot;key&quot;: &quot;a&quot;,\n  &quot;note&quot;: &quot;&lt;i&gt;x&lt;/i&gt;&quot;\n}"
        in html
    )
    assert "{&quot;expression&quot;: &quot;1 +\n(not valid JSON)" in html
    assert html.count('class="tool-call"') == 2


def test_only_tool_errors_are_highlighted():
    ok, failed = _tool_bubbles(episode_html(_tool_episode()))
    assert TOOL_ERROR_COLOR not in ok and "<b" not in ok
    assert TOOL_ERROR_COLOR in failed and ">tool_error</b>" in failed
    assert "answer to call_0" in ok and "answer to call_1" in failed


def test_an_environment_error_shows_its_traceback():
    episode = _tool_episode()
    assert "episode-error" not in episode_html(episode)
    episode.end_cause = EndCause.ERROR
    episode.error = "Env.step raised:\nTraceback (most recent call last):\nKeyError: '<k>'"
    html = episode_html(episode)
    assert 'class="episode-error"' in html and "KeyError: &#x27;&lt;k&gt;&#x27;" in html
    assert "ERROR" in html and "never trained on" in html


def test_the_unparsed_reply_of_a_parse_failure_is_marked():
    episode = _tool_episode()
    assert "never sent to the environment" not in episode_html(episode)
    episode.end_cause, episode.reward = EndCause.PARSE_FAILURE, -1.0
    html = episode_html(episode)
    assert "reward -1</b>" in html and "failed_parse_reward" in html
    last_bubble = html.split('<div class="msg msg-assistant"')[-1]
    assert "never sent to the environment" in last_bubble


def _turn(prompt: list[int], sampled: list[int], logprob: float, version: int = 0) -> Turn:
    return Turn(prompt, sampled, [logprob] * len(sampled), [version] * len(sampled))


def _spans(html: str) -> list[tuple[str, str, str]]:
    """(class, background, title) of every token span, in order."""
    pattern = r'<span class="tok (tok-\w+)" style="background:(#\w+)" title="([^"]*)">'
    return re.findall(pattern, html)


def test_tokens_are_coloured_by_the_training_mask(tokenizer):
    prompt = tokenizer.encode("What is <b>a</b>?", add_special_tokens=False)
    reply = tokenizer.encode("It is\n7", add_special_tokens=False)
    tool = tokenizer.encode(" tool says 7", add_special_tokens=False)
    answer = tokenizer.encode("7", add_special_tokens=False)
    episode = _tool_episode()
    episode.turns = [
        _turn(prompt, reply, -0.25),
        _turn(prompt + reply + tool, answer, -1.5, version=3),
    ]
    html = tokens_html(episode, tokenizer)
    (sequence,) = episode.token_sequences()
    spans = _spans(html)
    assert [cls == "tok-sampled" for cls, _, _ in spans] == sequence.assistant_mask_T
    assert {bg for cls, bg, _ in spans if cls == "tok-sampled"} == {SAMPLED_COLOR}
    assert {bg for cls, bg, _ in spans if cls == "tok-prompt"} == {PROMPT_COLOR}
    # Hover titles carry the token id, and for sampled tokens the sampling log-prob and version.
    titles = [title for _, _, title in spans]
    assert titles[0].startswith(f"id {prompt[0]} ") and "not trained" in titles[0]
    assert titles[len(prompt)] == f"id {reply[0]} · sampling logprob -0.250 · policy v0"
    assert titles[-1] == f"id {answer[0]} · sampling logprob -1.500 · policy v3"
    # The prompt's markup is escaped token by token, and line breaks are shown and kept.
    assert "<b>" not in html and "&lt;" in html
    assert "\u21b5\n" in html
    assert f"{len(sequence)} tokens, {len(reply) + len(answer)} sampled and trained" in html
    assert "Sequence 1 of" not in html


def test_each_training_sequence_gets_its_own_heading(tokenizer):
    episode = _tool_episode()
    first = tokenizer.encode("one", add_special_tokens=False)
    second = tokenizer.encode("two", add_special_tokens=False)
    # The second prompt does not extend the first turn: a rewritten history, so a new sequence.
    episode.turns = [_turn(first, [5], -0.1), _turn(second, [6, 7], -0.2)]
    html = tokens_html(episode, tokenizer)
    assert "Sequence 1 of 2" in html and "Sequence 2 of 2" in html
    assert html.count('class="sequence"') == 2
    assert len(_spans(html)) == len(first) + 1 + len(second) + 2


def test_an_episode_without_tokens_says_so(tokenizer):
    html = tokens_html(_tool_episode(), tokenizer)
    assert "No tokens" in html and "tok-" not in html


def test_episodes_table_follows_the_seed_table():
    episodes = []
    for cause in (EndCause.TERMINATED, EndCause.MAX_TURNS, EndCause.ENV, EndCause.ERROR):
        episode = _tool_episode()
        episode.end_cause = cause
        episodes.append(episode)
    html = episodes_table_html(episodes, labels=["done", "turns", "env", "<boom>"])
    rows = [re.findall(r"<td [^>]*>(.*?)</td>", row) for row in html.split("<tr>")[2:]]
    # columns: label, badge, truncation, overlong penalty, trained, with overlong_masking, reward
    assert [row[2:6] for row in rows] == [
        ["no", "no", "yes", "yes"],
        ["yes", "yes", "yes", "no"],
        ["yes", "no", "yes", "no"],
        ["no", "no", "no", "no"],
    ]
    assert rows[3][0] == "&lt;boom&gt;"
    with pytest.raises(ValueError, match="labels"):
        episodes_table_html(episodes, labels=["one"])


def test_episode_viewer_switches_episodes(tokenizer):
    first, second = _tool_episode(), _tool_episode()
    second.end_cause, second.reward = EndCause.MAX_TURNS, 0.5
    second.turns = [_turn([1, 2, 3], [4, 5], -0.3)]
    viewer = EpisodeViewer([first, second], tokenizer)
    labels = [label for label, _ in viewer.selector.options]
    assert labels[0].startswith("#0 · reward 0 · TERMINATED") and labels[1].startswith(
        "#1 · reward 0.5 · MAX_TURNS"
    )
    assert viewer.messages_pane.value == episode_html(first)
    assert "No tokens" in viewer.tokens_pane.value
    viewer.selector.value = 1  # what choosing in the dropdown does
    assert viewer.messages_pane.value == episode_html(second)
    assert viewer.tokens_pane.value == tokens_html(second, tokenizer)
    viewer.next_button.click()  # wraps around to the first episode
    assert viewer.index == 0 and viewer.messages_pane.value == episode_html(first)
    viewer.previous_button.click()
    assert viewer.index == 1
    assert isinstance(viewer.children[1], widgets.Tab)


def test_episode_viewer_without_tokenizer_shows_messages_only():
    viewer = EpisodeViewer([_tool_episode()])
    assert viewer.children[1] is viewer.messages_pane
    with pytest.raises(ValueError, match="at least one episode"):
        EpisodeViewer([])


def test_reasoning_is_shown_folded_apart_from_the_answer():
    reply = Message(role="assistant", content="42", reasoning_content="6 <times> 7")
    episode = Episode(
        task=Task(prompt="q", target=42),
        messages=[Message(role="user", content="q"), reply],
        reward=1.0,
        end_cause=EndCause.TERMINATED,
        num_turns=1,
    )
    html = episode_html(episode)
    assert '<details class="reasoning">' in html and "6 &lt;times&gt; 7" in html
    assert html.index("6 &lt;times&gt; 7") < html.index(">42</pre>")


def test_side_by_side_puts_each_text_in_its_own_escaped_column():
    from cookbook_lib.display.viewer import side_by_side_html

    html = side_by_side_html({"Qwen3.6": "<|im_start|>user", "gpt-oss": "<|start|>user"})
    assert html.count("<pre") == 2 and "&lt;|im_start|&gt;user" in html and "<b>gpt-oss</b>" in html
