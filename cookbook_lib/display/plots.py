"""Plotly figures the notebooks share: how episodes ended, and what they earned.

Each builder takes a list of episodes or an :class:`~cookbook_lib.rollout.evaluate.EvalReport` and returns
a ``plotly.graph_objects.Figure``, so a notebook can show it, restyle it or save it. Colours of end
causes are fixed here (and reused by the episode viewer) so that a cause looks the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from cookbook_lib.rollout.episode import EndCause, Episode

if TYPE_CHECKING:
    from cookbook_lib.rollout.evaluate import EvalReport

# Green for a normal end; oranges for the two causes the overlong penalty applies to; a colour of
# its own for each other truncation; grey for an environment error (never trained on).
END_CAUSE_COLORS: dict[EndCause, str] = {
    EndCause.TERMINATED: "#2ca02c",
    EndCause.CONTEXT_OVERFLOW: "#ff7f0e",
    EndCause.MAX_TURNS: "#f2b134",
    EndCause.ENV: "#9467bd",
    EndCause.PARSE_FAILURE: "#d62728",
    EndCause.ERROR: "#7f7f7f",
}


def episodes_of(source: EvalReport | Sequence[Episode]) -> list[Episode]:
    """The episodes of a report, or the given episodes as a list."""
    episodes = getattr(source, "episodes", source)
    return list(episodes)


def end_cause_counts(source: EvalReport | Sequence[Episode]) -> dict[EndCause, int]:
    """How many episodes ended with each cause: every cause, in the seed's order, zeros included.

    Zeros are kept on purpose: "no context overflow at all" is an answer worth seeing.
    """
    counts = dict.fromkeys(EndCause, 0)
    for episode in episodes_of(source):
        counts[episode.end_cause] += 1
    return counts


def end_cause_figure(
    source: EvalReport | Sequence[Episode], title: str = "How the episodes ended"
) -> go.Figure:
    """A bar per end cause (the seed's order, empty causes as zero-height bars).

    The hover text says whether the soft overlong penalty applies to the cause, the part of the
    seed's table that later changes rewards.
    """
    counts = end_cause_counts(source)
    causes = list(counts)
    penalty = ["overlong penalty applies" if cause.is_overlong else "no overlong penalty" for cause in causes]
    figure = go.Figure(
        go.Bar(
            x=[cause.value for cause in causes],
            y=list(counts.values()),
            marker_color=[END_CAUSE_COLORS[cause] for cause in causes],
            text=list(counts.values()),
            textposition="outside",
            customdata=penalty,
            hovertemplate="%{x}: %{y} episodes<br>%{customdata}<extra></extra>",
        )
    )
    figure.update_layout(
        title=title,
        xaxis_title="end cause",
        yaxis_title="episodes",
        yaxis_rangemode="tozero",
        height=360,
        margin={"t": 60, "b": 40},
    )
    return figure


def reward_histogram(
    source: EvalReport | Sequence[Episode],
    title: str = "Rewards, by how the episode ended",
    bin_size: float | None = None,
) -> go.Figure:
    """A histogram of episode rewards, stacked by end cause (one trace per cause present).

    Stacking by cause shows at a glance where a reward came from: a 0.0 from a wrong final answer
    (TERMINATED) and a 0.0 from running out of turns look the same in a mean but are treated
    differently by training. ``bin_size`` defaults to a twentieth of the reward range.

    When every episode earned the same reward (a base model that never solves a task), a default
    histogram is one bar as wide as the axis with no number under it; here the bar is a fifth of a
    unit wide, centred in a fixed range with a tick at the reward, and a note says so.
    """
    episodes = episodes_of(source)
    if not episodes:
        raise ValueError("no episodes to plot")
    rewards = [episode.reward for episode in episodes]
    low, high = min(rewards), max(rewards)
    unit = max(1.0, abs(low))  # the scale of a single reward: 0 and 1 read on [-0.5, 1.5]-ish axes
    size = bin_size if bin_size is not None else ((high - low) / 20 if high > low else unit / 5)
    if size <= 0:
        raise ValueError(f"bin_size must be positive, got {size}")
    bins = go.histogram.XBins(start=low - size / 2, end=high + size / 2, size=size)
    figure = go.Figure()
    for cause in EndCause:
        cause_rewards = [episode.reward for episode in episodes if episode.end_cause is cause]
        if cause_rewards:
            figure.add_trace(
                go.Histogram(
                    x=cause_rewards,
                    xbins=bins,
                    name=cause.value,
                    marker_color=END_CAUSE_COLORS[cause],
                    hovertemplate=f"{cause.value}<br>reward %{{x}}: %{{y}} episodes<extra></extra>",
                )
            )
    figure.update_layout(
        title=title,
        barmode="stack",
        xaxis_title="reward",
        yaxis_title="episodes",
        height=360,
        margin={"t": 60, "b": 40},
    )
    if high == low:
        figure.update_xaxes(range=[low - unit, low + unit], tickvals=[low - unit, low, low + unit])
        figure.add_annotation(
            text=f"all {len(rewards)} episodes earned {low:g}",
            xref="paper",
            yref="paper",
            x=0.99,
            xanchor="right",
            y=0.98,
            yanchor="top",  # inside the plot, beside the one bar: clear of the title
            showarrow=False,
        )
    return figure
