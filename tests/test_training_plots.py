"""Training curves: the static figure and the live notebook widget draw exactly the logged points."""

from __future__ import annotations

import json
import math
import threading

import pytest

from cookbook_lib.display.training_plots import (
    ASYNC_PANELS,
    CURVES,
    EMPTY_TEXT,
    HORIZONTAL_SPACING,
    PANEL_TITLES,
    PLACEHOLDER_NAME,
    TRAINING_PANELS,
    Curve,
    LiveTrainingPlots,
    Panel,
    Panels,
    curve_points,
    metrics_table_figure,
    step_axis_range,
    training_curves_figure,
)
from cookbook_lib.grpo.lockstep import StepOutcome
from cookbook_lib.runtime.metrics import MetricsLogger

# What a run of three steps logs: step 0 is validation only, step 2 did not validate.
METRICS = [
    {"step": 0, "val/reward_mean": 0.25, "val/terminated_ratio": 1.0},
    {
        "step": 1,
        "reward_mean": 0.5,
        "terminated_ratio": 0.75,
        "truncated_ratio": 0.25,
        "max_turns_ratio": 0.25,
        "context_overflow_ratio": 0.0,
        "parse_failure_ratio": 0.0,
        "zero_variance_skip_ratio": 0.5,
        "train/policy_loss": -0.01,
        "train/entropy": 1.5,
        "train/grad_norm": 3.0,
        "time/step_s": 20.0,
    },
    {
        "step": 2,
        "reward_mean": 0.625,
        "terminated_ratio": 1.0,
        "train/policy_loss": 0.02,
        "time/step_s": 18.0,
    },
    {"step": 3, "reward_mean": 0.75, "val/reward_mean": 0.5, "train/policy_loss": None, "time/step_s": 19.5},
]


def _titles(figure):
    """The panel titles (the unnamed annotations; "no data yet" notes are named)."""
    return [a for a in figure.layout.annotations if a.name is None]


def _empty_notes(figure) -> dict[str, bool]:
    """Panel axis ("x", "x2", ...) -> whether its "no data yet" note shows."""
    notes = [a for a in figure.layout.annotations if a.name]
    assert {a.text for a in notes} <= {EMPTY_TEXT, "no data"}  # live / finished
    return {a.xref.removesuffix(" domain"): a.visible is not False for a in notes}


def _xaxes(figure):
    return [figure.layout[name] for name in sorted(figure.layout) if name.startswith("xaxis")]


def _trace(figure, name):
    (trace,) = [trace for trace in figure.data if trace.name == name]
    return trace


def test_the_figure_plots_each_metric_at_the_steps_that_logged_it():
    figure = training_curves_figure(METRICS)
    train = _trace(figure, "train reward")
    assert list(train.x) == [1, 2, 3] and list(train.y) == [0.5, 0.625, 0.75]
    val = _trace(figure, "validation reward")
    assert list(val.x) == [0, 3] and list(val.y) == [0.25, 0.5]  # no point at steps 1 and 2
    loss = _trace(figure, "policy loss")
    assert list(loss.x) == [1, 2] and list(loss.y) == [-0.01, 0.02]  # None at step 3 is skipped
    assert list(_trace(figure, "terminated").y) == [0.75, 1.0]
    assert list(_trace(figure, "zero-variance groups skipped").x) == [1]


def test_each_curve_goes_to_its_panel():
    figure = training_curves_figure(METRICS)
    # Subplots number their axes x, x2, x3, x4 in row order: the panels of CURVES.
    expected_axis = {1: "x", 2: "x2", 3: "x3", 4: "x4"}
    for curve in CURVES:
        assert _trace(figure, curve.name).xaxis == expected_axis[curve.panel], curve.key
    # Panels are legend groups; a click must still hide one curve, not its whole panel.
    assert figure.layout.legend.groupclick == "toggleitem"


def _curves(figure) -> list[str]:
    """The names of the drawn curves (not the placeholders that keep empty panels' axes)."""
    return [trace.name for trace in figure.data if trace.name != PLACEHOLDER_NAME]


def test_missing_metrics_leave_their_curves_out():
    figure = training_curves_figure([{"step": 1, "reward_mean": 0.1}, {"step": 2}])
    assert _curves(figure) == ["train reward"]
    assert _curves(training_curves_figure([])) == []
    # Each empty panel keeps its axes with one empty trace, out of the legend.
    placeholders = [trace for trace in figure.data if trace.name == PLACEHOLDER_NAME]
    assert [trace.xaxis for trace in placeholders] == ["x2", "x3", "x4"]
    assert all(trace.showlegend is False and len(trace.x) == 0 for trace in placeholders)


def test_nan_inf_text_and_bools_are_not_points():
    records = [
        {"step": 1, "reward_mean": math.nan},
        {"step": 2, "reward_mean": math.inf},
        {"step": 3, "reward_mean": "0.5"},
        {"step": 4, "reward_mean": True},
        {"step": 5, "reward_mean": 1},
    ]
    assert curve_points(records, "reward_mean") == ([5], [1.0])


def test_the_figure_writes_html(tmp_path):
    path = tmp_path / "training_curves.html"
    training_curves_figure(METRICS).write_html(path, include_plotlyjs=False)
    assert "validation reward" in path.read_text()


def test_metrics_table_has_a_row_per_step_and_blank_cells_for_missing_metrics():
    (table,) = metrics_table_figure(METRICS).data
    headers = list(table.header.values)
    columns = dict(zip(headers, table.cells.values, strict=True))
    assert list(columns["step"]) == ["0", "1", "2", "3"]
    assert list(columns["val reward"]) == ["0.250", "", "", "0.500"]
    assert list(columns["loss"]) == ["", "-0.010", "0.020", ""]


def _outcome(step: int, reward: float, **extra: float) -> StepOutcome:
    return StepOutcome(step=step, metrics={"reward_mean": reward, **extra}, episodes=[])


def test_live_plots_take_step_outcomes_and_dicts():
    live = LiveTrainingPlots(num_steps=3)
    assert live.progress.value == 0 and live.progress.max == 3
    live(_outcome(1, 0.5, **{"time/step_s": 12.0}))
    live.update({"step": 2, "reward_mean": 0.75, "val/reward_mean": 0.5})
    train = _trace(live.figure, "train reward")
    assert list(train.x) == [1, 2] and list(train.y) == [0.5, 0.75]
    assert list(_trace(live.figure, "validation reward").x) == [2]
    assert live.progress.value == 2
    assert "step 2/3" in live.label.value and "val reward 0.500" in live.label.value
    live.update({"reward_mean": 1.0})  # no step: the next one
    assert list(_trace(live.figure, "train reward").x) == [1, 2, 3]
    assert live.progress.value == 3 and live.progress.bar_style == "success"
    assert [record["step"] for record in live.metrics] == [1, 2, 3]


def test_live_plots_keep_every_curve_even_before_data():
    live = LiveTrainingPlots()
    assert [trace.name for trace in live.figure.data] == [curve.name for curve in CURVES]
    assert all(len(trace.x) == 0 for trace in live.figure.data)
    assert live.label.value == "waiting for the first step"
    assert live.widget.children[1] is live.figure


def test_live_plots_seeded_with_earlier_metrics_and_replacing_a_retrained_step():
    live = LiveTrainingPlots(num_steps=None, metrics=METRICS[:2])
    assert list(_trace(live.figure, "validation reward").x) == [0]
    assert live.progress.value == 1
    live(_outcome(1, 0.9))  # a resumed run trains step 1 again: the new record replaces the old one
    assert list(_trace(live.figure, "train reward").y) == [0.9]
    live(_outcome(7, 0.1))  # without num_steps the bar grows with the run
    assert live.progress.max == 7 and live.progress.value == 7


def test_live_plots_read_the_step_zero_validation_from_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    live = LiveTrainingPlots(num_steps=2, run_dir=run_dir)  # the run has not started yet
    with MetricsLogger(run_dir, wandb_project=None, run_name="run") as log:
        log.log(0, {"val/reward_mean": 0.25})
        log.log(1, {"reward_mean": 0.5})
        live(_outcome(1, 0.5))  # on_step comes after the step is logged; step 0 never comes
    val = _trace(live.figure, "validation reward")
    assert list(val.x) == [0] and list(val.y) == [0.25]
    assert list(_trace(live.figure, "train reward").x) == [1]
    # A half-written last line (the logger is mid-write) is not read as a record.
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 2, "reward_mean": 0.7})[:10])
    live(_outcome(2, 0.75))
    assert list(_trace(live.figure, "train reward").y) == [0.5, 0.75]


def test_live_plots_update_from_another_thread():
    live = LiveTrainingPlots(num_steps=20)
    errors: list[BaseException] = []

    def train() -> None:  # what train_multi_turn's worker thread does in a notebook
        try:
            for step in range(1, 11):
                live(_outcome(step, step / 10))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=train), threading.Thread(target=lambda: live.metrics)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors
    assert list(_trace(live.figure, "train reward").x) == list(range(1, 11))
    assert live.progress.value == 10


def test_a_drawing_failure_is_logged_not_raised(monkeypatch, caplog):
    live = LiveTrainingPlots(num_steps=2)

    def broken():
        raise RuntimeError("comm closed")

    monkeypatch.setattr(live.figure, "batch_update", broken)
    live(_outcome(1, 0.5))  # must not raise: it runs inside the training loop
    assert "could not update the live training plots" in caplog.text
    assert [record["step"] for record in live.metrics] == [1]  # the data is kept for the next push


@pytest.mark.parametrize("bad", [{"step": "one"}, object()])
def test_bad_input_fails_loudly(bad):
    with pytest.raises((TypeError, ValueError, AttributeError)):
        LiveTrainingPlots().update(bad)


# What an async run logs (the keys of cookbook_lib.grpo.async_loop), step 0 validation only.
ASYNC_METRICS = [
    {"step": 0, "val/reward_mean": 0.25},
    {
        "step": 1,
        "reward_mean": 0.5,
        "time/step_s": 30.0,
        "async/train_wait_s": 28.0,
        "async/dropped_stale_groups": 0.0,
        "async/policy_age_mean": 0.0,
        "async/policy_age_max": 0.0,
    },
    {
        "step": 2,
        "reward_mean": 0.625,
        "val/reward_mean": 0.5,
        "time/step_s": 12.0,
        "async/train_wait_s": 4.5,
        "async/dropped_stale_groups": 2.0,
        "async/policy_age_mean": 0.75,
        "async/policy_age_max": 1.0,
    },
]


def test_the_default_panels_are_the_training_curves():
    assert TRAINING_PANELS.curves == CURVES
    assert tuple(panel.title for panel in TRAINING_PANELS.panels) == PANEL_TITLES
    figure = training_curves_figure(METRICS)
    assert [a.text for a in _titles(figure)] == list(PANEL_TITLES)
    assert tuple(figure.layout.yaxis2.range) == (-0.05, 1.05)  # the end-cause ratios keep a fixed scale


def test_async_panels_plot_waiting_stale_groups_and_policy_age():
    figure = training_curves_figure(ASYNC_METRICS, panels=ASYNC_PANELS)
    expected = {
        "train reward": ("x", [1, 2], [0.5, 0.625]),
        "validation reward": ("x", [0, 2], [0.25, 0.5]),
        "trainer waiting for groups": ("x2", [1, 2], [28.0, 4.5]),
        "whole step": ("x2", [1, 2], [30.0, 12.0]),
        "stale groups dropped": ("x3", [1, 2], [0.0, 2.0]),
        "mean age": ("x4", [1, 2], [0.0, 0.75]),
        "max age": ("x4", [1, 2], [0.0, 1.0]),
    }
    assert sorted(_curves(figure)) == sorted(expected)
    for name, (axis, steps, values) in expected.items():
        trace = _trace(figure, name)
        assert (trace.xaxis, list(trace.x), list(trace.y)) == (axis, steps, values), name
    assert figure.layout.yaxis3.rangemode == "tozero"  # no drops reads as 0, not as a flat line at 0.5
    # A lockstep run has no async metrics: only its rewards (and step time) are drawn.
    lockstep = training_curves_figure(METRICS, panels=ASYNC_PANELS)
    assert sorted(_curves(lockstep)) == [
        "train reward",
        "validation reward",
        "whole step",
    ]


def test_live_async_plots_update_each_panel():
    live = LiveTrainingPlots(num_steps=2, panels=ASYNC_PANELS, metrics=ASYNC_METRICS[:1])
    assert [trace.name for trace in live.figure.data] == [curve.name for curve in ASYNC_PANELS.curves]
    for record in ASYNC_METRICS[1:]:
        live(StepOutcome(step=record["step"], metrics=dict(record), episodes=[]))
    assert list(_trace(live.figure, "max age").y) == [0.0, 1.0]
    assert list(_trace(live.figure, "stale groups dropped").y) == [0.0, 2.0]
    assert list(_trace(live.figure, "trainer waiting for groups").y) == [28.0, 4.5]
    assert list(_trace(live.figure, "validation reward").x) == [0, 2]
    assert "4.5 s waiting" in live.label.value and live.progress.bar_style == "success"


def test_panels_can_be_any_number_and_check_their_curves():
    three = Panels(
        panels=(Panel("A", "a"), Panel("B", "b", from_zero=True), Panel("C", "c", y_range=(0, 1))),
        curves=(Curve("reward_mean", "r", 1, "red"), Curve("x", "x", 3, "blue")),
    )
    assert three.rows == 2 and [three.cell(i) for i in (1, 2, 3)] == [(1, 1), (1, 2), (2, 1)]
    figure = training_curves_figure([{"step": 1, "reward_mean": 1.0, "x": 0.5}], panels=three)
    assert [trace.xaxis for trace in figure.data if trace.name != PLACEHOLDER_NAME] == ["x", "x3"]
    assert [a.xref for a in figure.layout.annotations if a.visible is not False and a.name] == ["x2 domain"]
    with pytest.raises(ValueError, match="panel 5"):
        Panels(panels=three.panels, curves=(Curve("k", "k", 5, "red"),))
    with pytest.raises(ValueError, match="not both"):
        Panel("D", "d", y_range=(0, 1), from_zero=True)


# --- layout: width, titles, a shared step axis, empty panels -----------------------------------


def test_the_figures_fill_the_width_they_are_given():
    for figure in (training_curves_figure(METRICS), LiveTrainingPlots(num_steps=3).figure):
        assert figure.layout.autosize is True and figure.layout.width is None


# A narrow notebook (about 800 px) less the margins and the legend, and an upper bound of the mean
# glyph width of plotly's default font, per pixel of font size.
NARROW_PLOT_PX = 520
GLYPH_WIDTH = 0.62


@pytest.mark.parametrize("panels", [TRAINING_PANELS, ASYNC_PANELS])
def test_panel_titles_never_collide(panels):
    figure = training_curves_figure(METRICS, panels=panels)
    titles = _titles(figure)
    assert [t.text for t in titles] == [p.title for p in panels.panels]
    column_px = NARROW_PLOT_PX * (1 - HORIZONTAL_SPACING) / 2
    between_centres_px = column_px + NARROW_PLOT_PX * HORIZONTAL_SPACING
    widths = [len(t.text) * t.font.size * GLYPH_WIDTH for t in titles]
    for title, width in zip(titles, widths, strict=True):
        # Over its own panel: a right-column title must not run into the legend beside the plot.
        assert width / 2 <= column_px / 2 + 20, title.text
    for left, right in zip(widths[0::2], widths[1::2], strict=False):  # the two titles of a row
        assert (left + right) / 2 + 10 <= between_centres_px
    # Between two rows: the upper row's tick labels (~20 px) and the lower row's title, one line.
    layout = figure.layout
    plot_px = layout.height - layout.margin.t - layout.margin.b
    gap_px = (layout.yaxis.domain[0] - layout.yaxis3.domain[1]) * plot_px
    assert gap_px >= 20 + 1.5 * titles[0].font.size + 20
    # Above the first row: the figure's title, pinned to the top, then the first titles.
    assert layout.title.yref == "container" and layout.title.yanchor == "top"
    assert layout.margin.t >= 1.5 * 17 + 1.5 * titles[0].font.size + 30
    assert all(t.y == 1.0 and t.yanchor == "bottom" for t in titles[:2])


def test_panels_share_one_step_axis_from_step_zero_to_the_last_step():
    live = LiveTrainingPlots(num_steps=10)
    for figure, last in ((training_curves_figure(METRICS), 3), (live.figure, 10)):
        axes = _xaxes(figure)
        assert len(axes) == 4
        # One axis the others match: zooming one panel zooms them all.
        assert len({axis.matches for axis in axes if axis.matches}) == 1
        assert sum(axis.matches is None for axis in axes) == 1
        for axis in axes:
            assert tuple(axis.range) == tuple(step_axis_range(last))
            assert axis.range[0] < 0 and last < axis.range[1] < last + 1  # markers at 0 and the end show
            assert axis.showticklabels is True and axis.dtick >= 1
    live(_outcome(1, 0.5))  # before any step the axis already spans the whole run, and keeps it
    assert tuple(_xaxes(live.figure)[0].range) == tuple(step_axis_range(10))
    assert training_curves_figure(METRICS, num_steps=20).layout.xaxis.range[1] > 20


def test_without_num_steps_the_live_axis_grows_with_the_run():
    live = LiveTrainingPlots()
    assert tuple(live.figure.layout.xaxis.range) == tuple(step_axis_range(1))
    live(_outcome(1, 0.5))
    live(_outcome(25, 0.5))
    axis = live.figure.layout.xaxis
    assert tuple(axis.range) == tuple(step_axis_range(25)) and axis.dtick == 3


def test_an_empty_panel_says_so_until_its_first_point():
    live = LiveTrainingPlots(num_steps=3)
    assert _empty_notes(live.figure) == {"x": True, "x2": True, "x3": True, "x4": True}
    assert {a.text for a in live.figure.layout.annotations if a.name} == {EMPTY_TEXT}
    assert live.figure.layout.yaxis.showticklabels is False
    live.update({"step": 0, "val/reward_mean": 0.25})  # validation only: the reward panel has data
    assert _empty_notes(live.figure) == {"x": False, "x2": True, "x3": True, "x4": True}
    assert live.figure.layout.yaxis.showticklabels is True
    live(StepOutcome(step=1, metrics=dict(METRICS[1]), episodes=[]))
    assert not any(_empty_notes(live.figure).values())
    # The static figure too: a lockstep run drawn with the async panels has no stale groups or ages.
    figure = training_curves_figure(METRICS, panels=ASYNC_PANELS)
    assert _empty_notes(figure) == {"x": False, "x2": False, "x3": True, "x4": True}
    assert _empty_notes(training_curves_figure([])) == {"x": True, "x2": True, "x3": True, "x4": True}
    assert {a.text for a in figure.layout.annotations if a.name} == {"no data"}  # the run is over
