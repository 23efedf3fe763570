"""Training curves of a GRPO run: a static figure for ``runs/<run>/training_curves.html``, and a live
widget a notebook updates after every step.

Both draw panels from the step records of ``metrics.jsonl`` (one dict per step, the keys
:mod:`cookbook_lib.grpo.lockstep` and :mod:`cookbook_lib.grpo.async_loop` log). ``TRAINING_PANELS``,
the default, has four:

- reward: the training reward per step, and the validation reward at the steps that validated
  (step 0 is the validation before any GRPO step, i.e. of the warm-started model);
- how episodes ended: the seed's end-cause ratios, plus the share of groups skipped for zero variance;
- the policy loss;
- entropy and gradient norm, the first things to look at when a run goes wrong.

``ASYNC_PANELS`` is a second set of four panels for async runs (``max_steps_off_policy`` set): the
reward, how long each step waited for rollouts (``async/train_wait_s``), the stale groups dropped
(``async/dropped_stale_groups``) and the policy age of the trained groups (mean and max). Pass it as
``panels=`` to either the figure or the live widget.

A missing key or a ``None`` (a NaN written to JSON) leaves that step out of that curve only: a step
without validation has no validation point, rather than a misleading 0.

Layout, so the figure reads at any notebook width: it fills the width it is given (``autosize``);
every panel shares one step axis, fixed from step 0 to the last step (``num_steps`` for the live
plot), so the panels line up and do not rescale as points arrive; a panel with nothing to draw
says "no data yet"; and the space between rows leaves room for the tick labels of one row and the
title of the next.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cookbook_lib.display.plots import END_CAUSE_COLORS
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.runtime.metrics import read_metrics

if TYPE_CHECKING:
    from cookbook_lib.grpo.lockstep import StepOutcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Curve:
    """One line of the figure: the metric it plots, its legend name, its panel (1-based) and style."""

    key: str
    name: str
    panel: int
    color: str
    dash: str = "solid"
    marker_size: int = 5


@dataclass(frozen=True)
class Panel:
    """One subplot: its title, its heading in the legend, and how its y axis is scaled."""

    title: str
    legend: str
    y_range: tuple[float, float] | None = None  # a fixed range (ratios read the same across runs)
    from_zero: bool = False  # the axis starts at 0 (counts, seconds): a flat 0 reads as 0

    def __post_init__(self) -> None:
        if self.y_range is not None and self.from_zero:
            raise ValueError(f"panel {self.title!r}: give y_range or from_zero, not both")


@dataclass(frozen=True)
class Panels:
    """A figure's panels, two per row, and the curves drawn in them (``Curve.panel`` counts from 1)."""

    panels: tuple[Panel, ...]
    curves: tuple[Curve, ...]

    def __post_init__(self) -> None:
        for curve in self.curves:
            if not 1 <= curve.panel <= len(self.panels):
                raise ValueError(f"curve {curve.key!r} is in panel {curve.panel}, of 1-{len(self.panels)}")

    @property
    def rows(self) -> int:
        return (len(self.panels) + 1) // 2

    def cell(self, panel: int) -> tuple[int, int]:
        """The (row, col) of panel ``panel`` (1-based) in the grid."""
        return (panel - 1) // 2 + 1, (panel - 1) % 2 + 1

    def panel_of(self, curve: Curve) -> Panel:
        return self.panels[curve.panel - 1]


REWARD_CURVES = (
    Curve("reward_mean", "train reward", 1, "#1f77b4"),
    Curve("val/reward_mean", "validation reward", 1, "#ff7f0e", marker_size=9),
)

CURVES: tuple[Curve, ...] = (
    *REWARD_CURVES,
    Curve("terminated_ratio", "terminated", 2, END_CAUSE_COLORS[EndCause.TERMINATED]),
    Curve("truncated_ratio", "truncated (any cause)", 2, "#555555"),
    Curve("max_turns_ratio", "max turns", 2, END_CAUSE_COLORS[EndCause.MAX_TURNS], dash="dot"),
    Curve(
        "context_overflow_ratio", "context overflow", 2, END_CAUSE_COLORS[EndCause.CONTEXT_OVERFLOW], "dot"
    ),
    Curve("parse_failure_ratio", "parse failure", 2, END_CAUSE_COLORS[EndCause.PARSE_FAILURE], "dot"),
    Curve("zero_variance_skip_ratio", "zero-variance groups skipped", 2, "#9467bd", dash="dash"),
    Curve("train/policy_loss", "policy loss", 3, "#8c564b"),
    Curve("train/entropy", "entropy (nats)", 4, "#17becf"),
    Curve("train/grad_norm", "grad norm", 4, "#7f7f7f", dash="dash"),
)

TRAINING_PANELS = Panels(
    panels=(
        Panel("Reward", "Reward"),
        Panel("How episodes ended (share)", "End causes", y_range=(-0.05, 1.05)),
        Panel("Policy loss", "Loss"),
        Panel("Entropy and grad norm", "Entropy, grad norm"),
    ),
    curves=CURVES,
)
PANEL_TITLES = tuple(panel.title for panel in TRAINING_PANELS.panels)

ASYNC_CURVES: tuple[Curve, ...] = (
    *REWARD_CURVES,
    Curve("async/train_wait_s", "trainer waiting for groups", 2, "#c44e52"),
    Curve("time/step_s", "whole step", 2, "#7f7f7f", dash="dash"),
    Curve("async/dropped_stale_groups", "stale groups dropped", 3, "#9467bd"),
    Curve("async/policy_age_mean", "mean age", 4, "#2ca02c"),
    Curve("async/policy_age_max", "max age", 4, "#d62728", dash="dot"),
)

ASYNC_PANELS = Panels(
    panels=(
        Panel("Reward", "Reward"),
        Panel("Trainer wait per step (s)", "Waiting", from_zero=True),
        Panel("Stale groups dropped per step", "Stale groups", from_zero=True),
        Panel("Policy age of trained groups", "Policy age", from_zero=True),
    ),
    curves=ASYNC_CURVES,
)

TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "step"),
    ("reward_mean", "reward"),
    ("val/reward_mean", "val reward"),
    ("terminated_ratio", "terminated"),
    ("truncated_ratio", "truncated"),
    ("parse_failure_ratio", "parse fail"),
    ("zero_variance_skip_ratio", "zero-var skip"),
    ("train/policy_loss", "loss"),
    ("train/entropy", "entropy"),
    ("time/step_s", "step s"),
)


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything a curve should not draw (None, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def curve_points(metrics: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of ``key`` over step records, skipping records without a usable value."""
    steps: list[int] = []
    values: list[float] = []
    for record in metrics:
        value = _number(record.get(key))
        if value is not None and "step" in record:
            steps.append(int(record["step"]))
            values.append(value)
    return steps, values


def _scatter(curve: Curve, panel: Panel, steps: Sequence[int], values: Sequence[float]) -> go.Scatter:
    return go.Scatter(
        x=list(steps),
        y=list(values),
        name=curve.name,
        mode="lines+markers",
        line={"color": curve.color, "dash": curve.dash},
        marker={"size": curve.marker_size},
        legendgroup=str(curve.panel),
        legendgrouptitle_text=panel.legend,
        hovertemplate=f"{curve.name}<br>step %{{x}}: %{{y:.4g}}<extra></extra>",
    )


# Pixels. A row of panels; the gap between two rows holds the upper row's tick labels (~20 px)
# and the lower row's title (one line of TITLE_FONT_PX); the top margin holds the figure's title
# above the first row's titles.
PANEL_PX = 230
ROW_GAP_PX = 80
TOP_PX = 80
BOTTOM_PX = 55
TITLE_FONT_PX = 13
HORIZONTAL_SPACING = 0.1  # of the plotting width, between the two columns
EMPTY_TEXT = "no data yet"  # the live plot's; a finished run's figure says "no data"
PLACEHOLDER_NAME = "(empty panel)"


def step_axis_range(last_step: int) -> list[float]:
    """The shared x range: step 0 to ``last_step``, padded so the end markers are not cut in half."""
    last_step = max(int(last_step), 1)
    pad = max(0.3, 0.03 * last_step)
    return [-pad, last_step + pad]


def _axis_ref(axis: str, panel: int) -> str:
    """``x``/``y`` of panel ``panel`` (1-based, e.g. ``x2``): subplots number axes in panel order."""
    return f"{axis}{panel if panel > 1 else ''}"


def _grid(title: str, panels: Panels, last_step: int, empty_text: str = EMPTY_TEXT) -> go.Figure:
    rows = panels.rows
    plot_px = rows * PANEL_PX + (rows - 1) * ROW_GAP_PX
    figure = make_subplots(
        rows=rows,
        cols=2,
        subplot_titles=[panel.title for panel in panels.panels],
        shared_xaxes="all",
        vertical_spacing=ROW_GAP_PX / plot_px if rows > 1 else 0.0,
        horizontal_spacing=HORIZONTAL_SPACING,
    )
    figure.update_annotations(font_size=TITLE_FONT_PX)  # the panel titles, 16 px by default
    # Every panel keeps its own step labels: a reader of the top row should not look down for them.
    figure.update_xaxes(
        showticklabels=True, range=step_axis_range(last_step), tick0=0, dtick=_dtick(last_step)
    )
    figure.update_xaxes(title_text="step", row=rows)
    for number, panel in enumerate(panels.panels, start=1):
        row, col = panels.cell(number)
        if panel.y_range is not None:
            figure.update_yaxes(range=list(panel.y_range), row=row, col=col)
        elif panel.from_zero:
            figure.update_yaxes(rangemode="tozero", row=row, col=col)
        figure.add_annotation(
            text=empty_text,
            name=_empty_name(number),
            xref=f"{_axis_ref('x', number)} domain",
            yref=f"{_axis_ref('y', number)} domain",
            x=0.5,
            y=0.5,
            showarrow=False,
            font={"color": "#888", "size": 14},
        )
    figure.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "y": 0.99, "yanchor": "top", "yref": "container"},
        autosize=True,  # the notebook's width; plotly.js would otherwise draw 700 px wide
        height=TOP_PX + plot_px + BOTTOM_PX,
        margin={"t": TOP_PX, "b": BOTTOM_PX},
        legend={"tracegroupgap": 12, "groupclick": "toggleitem"},
    )
    return figure


def _dtick(last_step: int) -> int:
    """Whole steps between ticks, about ten ticks at most (never a tick at step 0.5)."""
    return max(1, math.ceil(max(int(last_step), 1) / 10))


def _empty_name(panel: int) -> str:
    return f"empty panel {panel}"


def _show_empty_panels(figure: go.Figure, panels: Panels, records: Sequence[Mapping[str, Any]]) -> None:
    """Say "no data yet" in each panel none of whose curves has a point, and hide its y labels."""
    for number in range(1, len(panels.panels) + 1):
        has_data = any(
            curve_points(records, curve.key)[0] for curve in panels.curves if curve.panel == number
        )
        for annotation in figure.layout.annotations:
            if annotation.name == _empty_name(number):
                annotation.visible = not has_data
        figure.layout[_axis_ref("y", number).replace("y", "yaxis")].showticklabels = has_data


def _last_step(records: Iterable[Mapping[str, Any]], num_steps: int | None) -> int:
    steps = [int(record["step"]) for record in records if "step" in record]
    return max([num_steps or 0, *steps])


def training_curves_figure(
    metrics: Sequence[Mapping[str, Any]],
    title: str = "Training curves",
    *,
    panels: Panels = TRAINING_PANELS,
    num_steps: int | None = None,
) -> go.Figure:
    """The panels from step records (``read_metrics(run_dir)`` or ``TrainResult.metrics``).

    Curves with no value at any step are left out, so a run without validation (or a test without
    a trainer) shows no empty legend entries; a panel left without curves says "no data".
    The step axis runs from 0 to ``num_steps`` (default: the last step logged).
    ``panels=ASYNC_PANELS`` draws an async run's panels.
    """
    figure = _grid(title, panels, _last_step(metrics, num_steps), empty_text="no data")
    drawn: set[int] = set()
    for curve in panels.curves:
        steps, values = curve_points(metrics, curve.key)
        if steps:
            row, col = panels.cell(curve.panel)
            figure.add_trace(_scatter(curve, panels.panel_of(curve), steps, values), row=row, col=col)
            drawn.add(curve.panel)
    for number in range(1, len(panels.panels) + 1):
        if number not in drawn:
            # plotly.js draws no axes for a subplot without a trace, and the note needs its axes.
            figure.add_trace(_placeholder(), row=panels.cell(number)[0], col=panels.cell(number)[1])
    _show_empty_panels(figure, panels, metrics)
    return figure


def _placeholder() -> go.Scatter:
    """An empty trace that keeps an empty panel's axes drawn; not in the legend."""
    return go.Scatter(x=[], y=[], name=PLACEHOLDER_NAME, showlegend=False, hoverinfo="skip")


def _cell(value: Any) -> str:
    number = _number(value)
    if number is None:
        return ""
    return str(value) if isinstance(value, int) else f"{number:.3f}"  # steps and counts stay integers


def metrics_table_figure(
    metrics: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]] = TABLE_COLUMNS
) -> go.Figure:
    """A plotly table of the step records, one row per step, ``columns`` as (key, header) pairs.

    A plotly table rather than a DataFrame because pandas is not a dependency; empty cells are
    metrics a step did not log (validation runs only every few steps).
    """
    table = go.Table(
        header={"values": [header for _, header in columns], "align": "left", "fill_color": "#e8e8e8"},
        cells={
            "values": [[_cell(record.get(key)) for record in metrics] for key, _ in columns],
            "align": "left",
        },
    )
    figure = go.Figure(table)
    figure.update_layout(
        height=min(120 + 28 * len(metrics), 600), margin={"t": 20, "b": 10, "l": 10, "r": 10}
    )
    return figure


class LiveTrainingPlots:
    """The training curves as a ``FigureWidget`` plus a progress bar, redrawn after every step.

    Pass the instance as ``on_step`` to ``train_multi_turn`` and display ``widget`` before the call::

        live = LiveTrainingPlots(num_steps=config.num_steps, run_dir=config.run_dir)
        display(live.widget)
        train_multi_turn(config, ..., on_step=live)

    ``panels`` picks what is drawn: the training curves (``TRAINING_PANELS``, the default) or an
    async run's waiting, stale groups and policy age (``ASYNC_PANELS``), or any ``Panels``.

    In a notebook, ``train_multi_turn`` runs its event loop on a worker thread, so ``update`` is
    called from that thread. Records are kept in plain Python (under a lock) and then pushed to the
    widgets; a failure to draw is logged, never raised, because a plot must not stop a training run.

    ``on_step`` is not called for step 0 (the validation before training), so with ``run_dir`` the
    plots read the steps they have not seen from ``metrics.jsonl``: the validation line then starts
    at step 0, and a resumed run shows its history.
    """

    def __init__(
        self,
        num_steps: int | None = None,
        *,
        metrics: Iterable[Mapping[str, Any]] = (),
        run_dir: str | Path | None = None,
        title: str = "Training curves (live)",
        panels: Panels = TRAINING_PANELS,
    ) -> None:
        self.num_steps = num_steps
        self.panels = panels
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._records: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.figure = go.FigureWidget(_grid(title, panels, num_steps or 1))
        for curve in panels.curves:
            row, col = panels.cell(curve.panel)
            self.figure.add_trace(_scatter(curve, panels.panel_of(curve), [], []), row=row, col=col)
        self.progress = widgets.IntProgress(value=0, min=0, max=max(num_steps or 1, 1), description="GRPO")
        self.label = widgets.Label(value="waiting for the first step")
        self._widget = widgets.VBox([widgets.HBox([self.progress, self.label]), self.figure])
        with self._lock:
            for record in metrics:
                self._add(record)
            self._backfill()
            self._push()

    @property
    def widget(self) -> widgets.VBox:
        """The progress bar above the figure: what a notebook displays."""
        return self._widget

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every step record received so far, in step order (copies)."""
        with self._lock:
            return [dict(self._records[step]) for step in sorted(self._records)]

    def update(self, outcome_or_metrics: StepOutcome | Mapping[str, Any]) -> None:
        """Add one step (a ``StepOutcome`` or a record dict with ``"step"``) and redraw.

        A dict without ``"step"`` is taken as the step after the last one seen. A step seen before
        (a resumed run trains it again) replaces the old record.
        """
        if isinstance(outcome_or_metrics, Mapping):
            record = dict(outcome_or_metrics)
        else:
            record = {**outcome_or_metrics.metrics, "step": outcome_or_metrics.step}
        with self._lock:
            self._backfill()
            if "step" not in record:
                record["step"] = max(self._records, default=0) + 1
            self._add(record)
            self._push()

    __call__ = update

    def _add(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        self._records[step] = {**record, "step": step}

    def _backfill(self) -> None:
        """Records of ``run_dir/metrics.jsonl`` not received yet (step 0, or a resumed run's past)."""
        if self.run_dir is None:
            return
        try:
            logged = read_metrics(self.run_dir)
        except (OSError, ValueError) as exc:  # a line being written, a folder not made yet
            logger.debug("could not read %s: %r", self.run_dir, exc)
            return
        for record in logged:
            if int(record["step"]) not in self._records:
                self._add(record)

    def _push(self) -> None:
        records = [self._records[step] for step in sorted(self._records)]
        try:
            with self.figure.batch_update():
                for trace, curve in zip(self.figure.data, self.panels.curves, strict=True):
                    trace.x, trace.y = curve_points(records, curve.key)
                _show_empty_panels(self.figure, self.panels, records)
                if self.num_steps is None:  # the axis grows with the run, still shared and from 0
                    last = _last_step(records, None)
                    self.figure.update_xaxes(range=step_axis_range(last), dtick=_dtick(last))
            self._update_progress(records)
        except Exception as exc:  # drawing must never fail the run that calls us
            logger.warning("could not update the live training plots: %r", exc)

    def _update_progress(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        last = records[-1]
        step = int(last["step"])
        if self.num_steps is None:
            self.progress.max = max(self.progress.max, step, 1)
        self.progress.value = min(step, self.progress.max)
        if self.num_steps is not None and step >= self.num_steps:
            self.progress.bar_style = "success"
        parts = [f"step {step}" + (f"/{self.num_steps}" if self.num_steps is not None else "")]
        reward = _number(last.get("reward_mean"))
        if reward is not None:
            parts.append(f"reward {reward:.3f}")
        val_steps, val_rewards = curve_points(records, "val/reward_mean")
        if val_steps:
            parts.append(f"val reward {val_rewards[-1]:.3f} (step {val_steps[-1]})")
        step_time = _number(last.get("time/step_s"))
        if step_time is not None:
            parts.append(f"{step_time:.1f} s/step")
        wait = _number(last.get("async/train_wait_s"))
        if wait is not None:  # an async run: how much of the step the trainer spent waiting
            parts.append(f"{wait:.1f} s waiting")
        self.label.value = " · ".join(parts)
