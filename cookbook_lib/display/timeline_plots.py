"""Timelines of runs drawn one above the other: which lane did what, when, and how much sat idle.

One subplot row per run (say "lockstep" above "async"), the lanes of that run as rows of horizontal
bars, the trainer on top. Each row's title gives the run's wall time, the trainer's training
fraction and the generators' mean sampling fraction, the numbers the async loop exists to raise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from cookbook_lib.runtime.timeline import (
    ENV,
    KINDS,
    SAMPLING,
    TRAINER_LANE,
    TRAINING,
    VALIDATION,
    WAITING,
    WEIGHT_SYNC,
    Span,
    Timeline,
    busy_fraction_of,
    is_generator_lane,
    run_window,
)

KIND_COLORS: dict[str, str] = {
    SAMPLING: "#1f77b4",
    ENV: "#2ca02c",
    TRAINING: "#ff7f0e",
    WEIGHT_SYNC: "#9467bd",
    VALIDATION: "#8c564b",
    WAITING: "#c7c7c7",
}
# Pixels: per lane, and per row around its lanes (title, spacing).
_LANE_HEIGHT = 32
_ROW_PADDING = 70


def idle_summary(spans: Sequence[Span]) -> dict[str, float]:
    """Where a run's time went, for a table comparing runs.

    ``wall_s``: origin to the last span's end. ``trainer_busy_fraction``: the trainer's ``TRAINING``
    time over the wall time (weight syncs, validation and waiting count as not training), and
    ``trainer_idle_fraction`` the rest. ``generator_busy_fraction``: the mean over generator lanes of
    their ``SAMPLING`` fractions. A fraction with nothing to measure (no spans, no trainer lane, no
    generator lane) is NaN rather than a misleading 0.
    """
    spans = list(spans)
    start, end = run_window(spans)
    has_trainer = any(span.lane == TRAINER_LANE for span in spans)
    trainer = busy_fraction_of(spans, TRAINER_LANE, TRAINING, start, end) if has_trainer else math.nan
    generator_lanes = sorted({span.lane for span in spans if is_generator_lane(span.lane)})
    generators = [busy_fraction_of(spans, lane, SAMPLING, start, end) for lane in generator_lanes]
    return {
        "wall_s": end - start,
        "trainer_busy_fraction": trainer,
        "trainer_idle_fraction": 1.0 - trainer,
        "generator_busy_fraction": sum(generators) / len(generators) if generators else math.nan,
    }


def _natural_key(text: str) -> list[int | str]:
    """Sort "generator 2" before "generator 10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def lane_order(spans: Sequence[Span]) -> list[str]:
    """The lanes of ``spans`` top to bottom: the trainer, then the others in natural order."""
    lanes = {span.lane for span in spans}
    rest = sorted(lanes - {TRAINER_LANE}, key=_natural_key)
    return [TRAINER_LANE, *rest] if TRAINER_LANE in lanes else rest


def _kind_colors(kinds: Sequence[str]) -> dict[str, str]:
    """Fixed colours for the known kinds; others from a palette, in order, the same in every row."""
    palette = qualitative.Dark24
    colors = dict(KIND_COLORS)
    for kind in kinds:
        if kind not in colors:
            colors[kind] = palette[(len(colors) - len(KIND_COLORS)) % len(palette)]
    return colors


def _fraction(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0%}"


def _row_title(name: str, spans: Sequence[Span]) -> str:
    if not spans:
        return f"{name}: no spans"
    summary = idle_summary(spans)
    return (
        f"{name}: wall {summary['wall_s']:.1f} s · trainer training "
        f"{_fraction(summary['trainer_busy_fraction'])} · generators sampling "
        f"{_fraction(summary['generator_busy_fraction'])}"
    )


def _bars(name: str, kind: str, spans: Sequence[Span], color: str, show_legend: bool) -> go.Bar:
    starts = np.fromiter((span.start for span in spans), dtype=float, count=len(spans))
    durations = np.fromiter((span.duration for span in spans), dtype=float, count=len(spans))
    return go.Bar(
        orientation="h",
        y=[span.lane for span in spans],
        x=durations,
        base=starts,
        customdata=np.column_stack([starts, durations]),
        name=kind,
        legendgroup=kind,
        showlegend=show_legend,
        marker={"color": color, "line": {"width": 0}},
        hovertemplate=(
            f"<b>{kind}</b><br>lane %{{y}}<br>start %{{customdata[0]:.3f}} s"
            f"<br>duration %{{customdata[1]:.3f}} s<extra>{name}</extra>"
        ),
    )


def timeline_figure(
    runs: Sequence[tuple[str, Timeline | Sequence[Span]]], title: str | None = None
) -> go.Figure:
    """One row per ``(name, timeline or spans)``, sharing an x axis of seconds since each run's start.

    One bar trace per kind per row, however many spans: thousands of spans draw as fast as a few.
    Each kind appears once in the legend; clicking it hides that kind in every row.
    """
    named = [(name, run.spans() if isinstance(run, Timeline) else list(run)) for name, run in runs]
    if not named:
        return go.Figure(layout={"title": title})
    lanes = [lane_order(spans) for _, spans in named]
    seen_kinds = {span.kind for _, spans in named for span in spans}
    kinds = [kind for kind in KINDS if kind in seen_kinds] + sorted(seen_kinds - set(KINDS))
    colors = _kind_colors(kinds)

    row_pixels = [_ROW_PADDING + _LANE_HEIGHT * max(len(row_lanes), 1) for row_lanes in lanes]
    height = 100 + sum(row_pixels)
    figure = make_subplots(
        rows=len(named),
        cols=1,
        shared_xaxes=True,
        subplot_titles=[_row_title(name, spans) for name, spans in named],
        row_heights=row_pixels,
        vertical_spacing=min(50 / height, 0.9 / max(len(named) - 1, 1)),
    )
    in_legend: set[str] = set()
    for row, ((name, spans), row_lanes) in enumerate(zip(named, lanes, strict=True), start=1):
        for kind in kinds:
            of_kind = [span for span in spans if span.kind == kind]
            if of_kind:
                figure.add_trace(
                    _bars(name, kind, of_kind, colors[kind], kind not in in_legend), row=row, col=1
                )
                in_legend.add(kind)
        # Categories are drawn bottom-up, so the reversed order puts the trainer on top.
        figure.update_yaxes(categoryorder="array", categoryarray=row_lanes[::-1], row=row, col=1)
    figure.update_xaxes(title_text="seconds since the run started", row=len(named), col=1)
    figure.update_layout(
        title=title,
        height=height,
        barmode="overlay",  # the default "group" would shift each kind's bars off their lane
        bargap=0.25,
        legend={"title": {"text": "kind"}, "traceorder": "normal"},
        margin={"t": 80 if title else 50, "b": 50},
    )
    return figure
