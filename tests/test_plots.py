"""The shared plotly figures: every end cause shown in the seed's order, rewards stacked by cause."""

from __future__ import annotations

import pytest

from cookbook_lib.display.plots import END_CAUSE_COLORS, end_cause_counts, end_cause_figure, reward_histogram
from cookbook_lib.envs import Task
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.rollout.evaluate import summarize

SEED_ORDER = ["TERMINATED", "CONTEXT_OVERFLOW", "MAX_TURNS", "ENV", "PARSE_FAILURE", "ERROR"]


def _episode(cause: EndCause, reward: float) -> Episode:
    return Episode(task=Task(prompt="q", target=1), messages=[], reward=reward, end_cause=cause)


EPISODES = [
    _episode(EndCause.TERMINATED, 1.0),
    _episode(EndCause.TERMINATED, 0.0),
    _episode(EndCause.TERMINATED, 1.0),
    _episode(EndCause.MAX_TURNS, 0.0),
    _episode(EndCause.PARSE_FAILURE, -1.0),
]


def test_end_cause_counts_keep_every_cause_in_the_seed_order():
    counts = end_cause_counts(EPISODES)
    assert [cause.value for cause in counts] == SEED_ORDER
    assert counts == {
        EndCause.TERMINATED: 3,
        EndCause.CONTEXT_OVERFLOW: 0,
        EndCause.MAX_TURNS: 1,
        EndCause.ENV: 0,
        EndCause.PARSE_FAILURE: 1,
        EndCause.ERROR: 0,
    }


def test_end_cause_figure_has_a_bar_per_cause_including_zeros():
    figure = end_cause_figure(EPISODES)
    (bar,) = figure.data
    assert list(bar.x) == SEED_ORDER
    assert list(bar.y) == [3, 0, 1, 0, 1, 0]
    assert list(bar.marker.color) == [END_CAUSE_COLORS[EndCause(name)] for name in SEED_ORDER]
    # The hover text carries the seed's table: the penalty applies to exactly the two overlong causes.
    penalised = [x for x, note in zip(bar.x, bar.customdata, strict=True) if note.startswith("overlong")]
    assert penalised == ["CONTEXT_OVERFLOW", "MAX_TURNS"]


def test_end_cause_figure_accepts_a_report():
    report = summarize([EPISODES[:3], EPISODES[2:]], wall_time_s=1.0)
    from_report = end_cause_figure(report).data[0]
    from_list = end_cause_figure(report.episodes).data[0]
    assert list(from_report.y) == list(from_list.y) == [4, 0, 1, 0, 1, 0]


def test_an_empty_list_gives_all_zero_bars():
    assert list(end_cause_figure([]).data[0].y) == [0] * len(SEED_ORDER)


def test_reward_histogram_stacks_one_trace_per_cause_present():
    figure = reward_histogram(EPISODES)
    assert figure.layout.barmode == "stack"
    assert [trace.name for trace in figure.data] == ["TERMINATED", "MAX_TURNS", "PARSE_FAILURE"]
    by_cause = {trace.name: sorted(trace.x) for trace in figure.data}
    assert by_cause == {"TERMINATED": [0.0, 1.0, 1.0], "MAX_TURNS": [0.0], "PARSE_FAILURE": [-1.0]}
    # All traces share one binning, centred on the extreme rewards, so stacked bars line up.
    bins = {(trace.xbins.start, trace.xbins.end, trace.xbins.size) for trace in figure.data}
    assert bins == {(-1.05, 1.05, 0.1)}


def test_reward_histogram_stays_readable_when_every_reward_is_equal():
    for reward in (0.0, 1.0, -3.0):
        figure = reward_histogram([_episode(EndCause.TERMINATED, reward)] * 3)
        (trace,) = figure.data
        low, high = figure.layout.xaxis.range
        # One narrow bar in the middle of a fixed range, not one bar as wide as the axis.
        assert (low + high) / 2 == pytest.approx(reward)
        assert trace.xbins.size / (high - low) <= 0.1
        assert trace.xbins.start < reward < trace.xbins.end
        assert reward in figure.layout.xaxis.tickvals  # the value is written under the bar
        (note,) = figure.layout.annotations
        assert note.text == f"all 3 episodes earned {reward:g}"
    spread = reward_histogram(EPISODES)
    assert spread.layout.xaxis.range is None and not spread.layout.annotations  # plotly's own range


def test_reward_histogram_bins_and_errors():
    assert reward_histogram(EPISODES, bin_size=0.5).data[0].xbins.size == 0.5
    with pytest.raises(ValueError, match="no episodes"):
        reward_histogram([])
    with pytest.raises(ValueError, match="bin_size"):
        reward_histogram(EPISODES, bin_size=0)
