"""The length mix of runs side by side: which episode lengths each run trained on, and which it dropped.

Reads the ``length/*`` metrics of each run's ``metrics.jsonl`` (see :mod:`cookbook_lib.grpo.length_mix`)
and draws three panels of grouped bars, one colour per run, one group of bars per length bucket
(assistant turns): the share of trained episodes, the share of trained tokens, and the share of the
groups of that length that were dropped as stale. Lockstep trains every group it samples, so its
bars are the reference mix; an async run whose first two panels match it has no length bias.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from cookbook_lib.grpo.length_mix import BucketMix, length_mix_summary

PANELS: tuple[tuple[str, str], ...] = (
    ("trained_episodes_share", "share of trained episodes"),
    ("trained_tokens_share", "share of trained tokens"),
    ("dropped_share", "share of groups dropped as stale"),
)


def bucket_label(bucket: str) -> str:
    """``turns_3-4`` -> ``3-4``: the axis says "assistant turns"."""
    return bucket.removeprefix("turns_")


def length_mix_figure(
    runs: Sequence[tuple[str, Iterable[Mapping[str, Any]]]], title: str | None = None
) -> go.Figure:
    """Grouped bars per ``(run name, metrics records)``, in three panels (see the module doc).

    Every run's bars cover the same buckets (a bucket a run never saw is drawn as 0), so the
    groups line up. Hovering a bar shows its share and the counts behind it.
    """
    summaries = [(name, length_mix_summary(records)) for name, records in runs]
    buckets = sorted(
        {mix.bucket for _, summary in summaries for mix in summary},
        key=lambda bucket: int(bucket_label(bucket).split("-")[0]),
    )
    figure = make_subplots(rows=1, cols=len(PANELS), subplot_titles=[label for _, label in PANELS])
    palette = qualitative.Plotly
    for run_index, (name, summary) in enumerate(summaries):
        by_bucket: dict[str, BucketMix] = {mix.bucket: mix for mix in summary}
        color = palette[run_index % len(palette)]
        for column, (attribute, label) in enumerate(PANELS, start=1):
            mixes = [by_bucket.get(bucket) for bucket in buckets]
            figure.add_trace(
                go.Bar(
                    x=[bucket_label(bucket) for bucket in buckets],
                    y=[getattr(mix, attribute) if mix is not None else 0.0 for mix in mixes],
                    customdata=[
                        [mix.groups if mix else 0.0, mix.dropped_stale_groups if mix else 0.0]
                        for mix in mixes
                    ],
                    name=name,
                    legendgroup=name,
                    showlegend=column == 1,
                    marker={"color": color},
                    hovertemplate=(
                        f"<b>{name}</b><br>%{{x}} turns<br>{label}: %{{y:.0%}}"
                        "<br>groups %{customdata[0]:.0f}, dropped stale %{customdata[1]:.0f}<extra></extra>"
                    ),
                ),
                row=1,
                col=column,
            )
            figure.update_xaxes(title_text="assistant turns", type="category", row=1, col=column)
            figure.update_yaxes(tickformat=".0%", rangemode="tozero", row=1, col=column)
    if not buckets:
        figure.add_annotation(
            text="no length metrics in these runs", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5
        )
    figure.update_layout(
        title=title,
        barmode="group",
        height=380,
        legend={"title": {"text": "run"}},
        margin={"t": 90 if title else 60, "b": 50},
    )
    return figure
