"""Training curves: the static figure and the live notebook widget draw exactly the logged points."""

from __future__ import annotations

import json
import math
import threading

import pytest

from cookbook_lib.grpo.lockstep import StepOutcome
from cookbook_lib.metrics import MetricsLogger
from cookbook_lib.training_plots import (
    ASYNC_PANELS,
    CURVES,
    PANEL_TITLES,
    TRAINING_PANELS,
    Curve,
    LiveTrainingPlots,
    Panel,
    Panels,
    curve_points,
    metrics_table_figure,
    training_curves_figure,
)

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


def test_missing_metrics_leave_their_curves_out():
    figure = training_curves_figure([{"step": 1, "reward_mean": 0.1}, {"step": 2}])
    assert [trace.name for trace in figure.data] == ["train reward"]
    assert training_curves_figure([]).data == ()


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
    assert [a.text for a in figure.layout.annotations] == list(PANEL_TITLES)
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
    assert sorted(trace.name for trace in figure.data) == sorted(expected)
    for name, (axis, steps, values) in expected.items():
        trace = _trace(figure, name)
        assert (trace.xaxis, list(trace.x), list(trace.y)) == (axis, steps, values), name
    assert figure.layout.yaxis3.rangemode == "tozero"  # no drops reads as 0, not as a flat line at 0.5
    # A lockstep run has no async metrics: only its rewards (and step time) are drawn.
    lockstep = training_curves_figure(METRICS, panels=ASYNC_PANELS)
    assert sorted(trace.name for trace in lockstep.data) == [
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
    assert [trace.xaxis for trace in figure.data] == ["x", "x3"]
    with pytest.raises(ValueError, match="panel 5"):
        Panels(panels=three.panels, curves=(Curve("k", "k", 5, "red"),))
    with pytest.raises(ValueError, match="not both"):
        Panel("D", "d", y_range=(0, 1), from_zero=True)
