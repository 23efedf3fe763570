"""The run timeline: merged spans, busy time, the JSONL file, the recorders and the figure."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

import pytest

from cookbook_lib.display.timeline_plots import idle_summary, lane_order, timeline_figure
from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.generators.stats import StepInfo
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.runtime.timeline import (
    ENV,
    SAMPLING,
    TRAINER_LANE,
    TRAINING,
    WAITING,
    WEIGHT_SYNC,
    Span,
    TimedEnv,
    Timeline,
    generator_step_recorder,
    replica_lane,
    timed_env_factory,
)
from cookbook_lib.types import Message, ToolSpec

G0, G1 = replica_lane(0), replica_lane(1)


def _timeline(gap: float = 0.01) -> Timeline:
    # Origin 0: absolute times are then the relative times the spans report.
    return Timeline(origin=0.0, merge_gap_s=gap)


def _reference_union(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Union by another route than the module's sweep: join every pair within ``gap`` (union-find),
    then take each group's hull. Quadratic, so for a few hundred intervals only."""
    parent = list(range(len(intervals)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (a_start, a_end) in enumerate(intervals):
        for j in range(i + 1, len(intervals)):
            b_start, b_end = intervals[j]
            if a_start <= b_end + gap and b_start <= a_end + gap:
                parent[root(i)] = root(j)
    hulls: dict[int, tuple[float, float]] = {}
    for i, (start, end) in enumerate(intervals):
        low, high = hulls.get(root(i), (start, end))
        hulls[root(i)] = (min(low, start), max(high, end))
    return sorted(hulls.values())


def _intervals(timeline: Timeline, lane: str, kind: str) -> list[tuple[float, float]]:
    return [(s.start, s.end) for s in timeline.spans() if s.lane == lane and s.kind == kind]


# --- union and merging ---------------------------------------------------------------------------


def test_overlapping_and_nested_spans_become_their_union():
    timeline = _timeline()
    timeline.add(G0, ENV, 1.0, 3.0)
    timeline.add(G0, ENV, 2.0, 4.0)  # overlaps
    timeline.add(G0, ENV, 2.5, 2.7)  # nested
    timeline.add(G0, ENV, 10.0, 11.0)  # apart
    assert _intervals(timeline, G0, ENV) == [(1.0, 4.0), (10.0, 11.0)]
    assert timeline.busy_s(G0, ENV) == pytest.approx(4.0)


def test_gaps_up_to_merge_gap_are_joined_and_larger_ones_kept():
    timeline = _timeline(gap=0.01)
    timeline.add(G0, SAMPLING, 0.0, 0.03)
    timeline.add(G0, SAMPLING, 0.035, 0.065)  # 5 ms after: one span
    timeline.add(G0, SAMPLING, 0.1, 0.13)  # 35 ms after: a new span
    assert _intervals(timeline, G0, SAMPLING) == [(0.0, 0.065), (0.1, 0.13)]


def test_out_of_order_arrival_gives_the_same_union():
    # Concurrent episodes finish in any order, so their spans arrive out of start order; enough of
    # them that the list is compacted while spans keep arriving.
    rng = random.Random(0)
    intervals = []
    for _ in range(600):
        start = rng.uniform(0, 600)
        intervals.append((start, start + rng.expovariate(2.0)))
    gap = 0.01
    timeline = _timeline(gap)
    for start, end in intervals:
        timeline.add(G0, ENV, start, end)
    got = _intervals(timeline, G0, ENV)
    assert got == _reference_union(intervals, gap)
    # Not all one span, and more spans than the list holds before its first compaction.
    assert 256 < len(got) < len(intervals)


def test_spans_are_kept_per_lane_and_kind_and_sorted():
    timeline = _timeline()
    timeline.add(TRAINER_LANE, TRAINING, 5.0, 6.0)
    timeline.add(G1, SAMPLING, 0.0, 1.0)
    timeline.add(G0, SAMPLING, 2.0, 3.0)
    timeline.add(G0, ENV, 0.5, 2.5)  # overlaps sampling on G0: a different kind, not merged
    assert timeline.spans() == [
        Span(G0, ENV, 0.5, 2.5),
        Span(G0, SAMPLING, 2.0, 3.0),
        Span(G1, SAMPLING, 0.0, 1.0),
        Span(TRAINER_LANE, TRAINING, 5.0, 6.0),
    ]
    assert timeline.lanes() == [TRAINER_LANE, G1, G0]  # first-recorded order


def test_a_span_may_not_end_before_it_starts():
    with pytest.raises(ValueError):
        _timeline().add(G0, ENV, 2.0, 1.0)


def test_span_context_manager_records_the_block_even_when_it_raises():
    timeline = Timeline()
    with timeline.span(TRAINER_LANE, TRAINING):
        pass
    with pytest.raises(RuntimeError), timeline.span(TRAINER_LANE, WEIGHT_SYNC):
        raise RuntimeError("boom")
    assert [s.kind for s in timeline.spans()] == [TRAINING, WEIGHT_SYNC]
    assert all(0.0 <= s.start <= s.end < 5.0 for s in timeline.spans())


def test_adding_from_several_threads_loses_nothing():
    timeline = _timeline(gap=0.0)
    barrier = threading.Barrier(4)

    def worker(index: int) -> None:
        barrier.wait()
        for i in range(500):
            # Each thread its own lane, plus all on one shared lane at interleaved times.
            timeline.add(replica_lane(index), SAMPLING, 10.0 * i, 10.0 * i + 1.0)
            timeline.add(TRAINER_LANE, WAITING, 10.0 * i + index, 10.0 * i + index + 0.5)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(4):
        assert len(_intervals(timeline, replica_lane(index), SAMPLING)) == 500
    assert len(_intervals(timeline, TRAINER_LANE, WAITING)) == 2000
    assert timeline.busy_s(TRAINER_LANE, WAITING) == pytest.approx(1000.0)


# --- busy time -----------------------------------------------------------------------------------


def test_busy_s_clips_to_the_window_and_unites_kinds():
    timeline = _timeline()
    timeline.add(G0, SAMPLING, 0.0, 4.0)
    timeline.add(G0, WEIGHT_SYNC, 3.0, 5.0)  # overlaps sampling by 1 s
    timeline.add(G0, SAMPLING, 8.0, 10.0)
    assert timeline.busy_s(G0) == pytest.approx(7.0)  # any kind: the overlap counted once
    assert timeline.busy_s(G0, SAMPLING) == pytest.approx(6.0)
    assert timeline.busy_s(G0, SAMPLING, start=2.0, end=9.0) == pytest.approx(3.0)
    assert timeline.busy_s(G0, start=4.5) == pytest.approx(2.5)
    assert timeline.busy_s(G1) == 0.0
    assert timeline.busy_fraction(G0, SAMPLING) == pytest.approx(0.6)  # window: 0 to 10
    assert timeline.busy_fraction(G0, SAMPLING, start=0.0, end=20.0) == pytest.approx(0.3)
    assert timeline.wall_s() == pytest.approx(10.0)
    assert math.isnan(_timeline().busy_fraction(G0))


# --- the file ------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    timeline = Timeline(merge_gap_s=0.02)
    rng = random.Random(1)
    origin = timeline.origin
    for _ in range(300):
        start = origin + rng.uniform(0, 30)
        timeline.add(rng.choice([G0, G1, TRAINER_LANE]), rng.choice([SAMPLING, ENV]), start, start + 0.1)
    path = tmp_path / "run" / "timeline.jsonl"
    timeline.save(path)
    loaded = Timeline.load(path)
    assert loaded.spans() == timeline.spans()
    assert loaded.lanes() == timeline.lanes()
    assert loaded.merge_gap_s == 0.02
    assert loaded.origin_unix == pytest.approx(timeline.origin_unix)
    assert len(path.read_text().splitlines()) == 1 + len(timeline.spans())
    assert not list(path.parent.glob("*.tmp"))


def test_load_refuses_other_files(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    with pytest.raises(ValueError):
        Timeline.load(path)


# --- recorders -----------------------------------------------------------------------------------


class CountingEnv(Env):
    """Two steps, each sleeping a little, counting its closes."""

    def __init__(self) -> None:
        self.closes = 0
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        await asyncio.sleep(0.01)
        self._messages = [{"role": "user", "content": task.prompt}]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        await asyncio.sleep(0.02)
        self._messages.append(message)
        done = len(self._messages) >= 3
        return StepResult(terminated=done, truncated=False, messages=list(self._messages), reward=1.0)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [{"type": "function", "function": {"name": "noop", "description": "", "parameters": {}}}]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self.closes += 1


def _policy(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
    return {"role": "assistant", "content": "ok"}


def test_timed_env_records_env_spans_and_closes_the_inner_env_once():
    timeline = Timeline()
    inner = CountingEnv()
    env = TimedEnv(inner, timeline, G0)
    assert env.tool_specs == inner.tool_specs
    episode = asyncio.run(run_episode(env, Task("hi"), _policy, max_turns=5))
    assert episode.reward == 1.0 and episode.num_turns == 2
    assert inner.closes == 1
    assert env.messages == inner.messages and len(env.messages) == 3
    spans = timeline.spans()
    assert {(s.lane, s.kind) for s in spans} == {(G0, ENV)}
    # reset + two steps sleep 50 ms; the policy and the loop between them take far less.
    assert 0.045 <= timeline.busy_s(G0, ENV) <= 1.0


def test_timed_env_factory_wraps_every_env_it_builds():
    timeline = Timeline()
    built: list[CountingEnv] = []

    def factory(task: Task) -> Env:
        built.append(CountingEnv())
        return built[-1]

    async def play() -> None:
        wrapped = timed_env_factory(factory, timeline, G1)
        await asyncio.gather(*(run_episode(wrapped, Task("t"), _policy, max_turns=5) for _ in range(3)))

    started = time.perf_counter()
    asyncio.run(play())
    wall = time.perf_counter() - started
    assert [env.closes for env in built] == [1, 1, 1]
    assert {s.lane for s in timeline.spans()} == {G1}
    # Three concurrent episodes of 50 ms env time each overlap: a union, not a 150 ms sum.
    assert 0.045 <= timeline.busy_s(G1, ENV) <= wall


def test_generator_step_recorder_records_sampling_spans():
    timeline = Timeline(origin=100.0)
    record = generator_step_recorder(timeline, G0)
    record(StepInfo("prefill", 4, 100.0, 100.5, policy_version=0, prefill_tokens=40))
    record(StepInfo("decode", 4, 100.501, 100.53, policy_version=0))  # 1 ms later: merged
    record(StepInfo("decode", 4, 101.0, 101.03, policy_version=1))
    spans = timeline.spans()
    assert [(s.lane, s.kind) for s in spans] == [(G0, SAMPLING)] * 2
    assert [(s.start, s.end) for s in spans] == [pytest.approx((0.0, 0.53)), pytest.approx((1.0, 1.03))]


# --- the figure ----------------------------------------------------------------------------------


def _run(trainer_busy: float) -> Timeline:
    timeline = _timeline()
    timeline.add(TRAINER_LANE, TRAINING, 0.0, trainer_busy)
    timeline.add(TRAINER_LANE, WAITING, trainer_busy, 10.0)
    for index in (0, 1, 10):
        timeline.add(replica_lane(index), SAMPLING, 0.0, 5.0)
        timeline.add(replica_lane(index), ENV, 5.0, 6.0)
    return timeline


def test_idle_summary():
    summary = idle_summary(_run(trainer_busy=2.5).spans())
    assert summary == pytest.approx(
        {
            "wall_s": 10.0,
            "trainer_busy_fraction": 0.25,
            "trainer_idle_fraction": 0.75,
            "generator_busy_fraction": 0.5,
        }
    )
    empty = idle_summary([])
    assert empty["wall_s"] == 0.0 and math.isnan(empty["trainer_busy_fraction"])
    generators_only = idle_summary([Span(G0, SAMPLING, 1.0, 2.0)])
    assert math.isnan(generators_only["trainer_busy_fraction"])  # no trainer lane: not "0% training"
    assert generators_only["generator_busy_fraction"] == pytest.approx(0.5)


def test_timeline_figure_has_a_row_per_run_and_a_trace_per_kind():
    figure = timeline_figure(
        [("lockstep", _run(2.5)), ("async", _run(8.0).spans()), ("empty", [])], title="compare"
    )
    assert figure.layout.title.text == "compare"
    rows = {trace.yaxis for trace in figure.data}
    assert rows == {"y", "y2"}  # the empty run has its row but no traces
    assert len(figure.data) == 2 * 4  # training, waiting, sampling, env in each non-empty row
    assert sorted(trace.name for trace in figure.data if trace.showlegend) == [
        ENV,
        SAMPLING,
        TRAINING,
        WAITING,
    ]
    colors = {}
    for trace in figure.data:
        assert trace.orientation == "h"
        assert colors.setdefault(trace.name, trace.marker.color) == trace.marker.color
    titles = [annotation.text for annotation in figure.layout.annotations]
    assert titles[0].startswith("lockstep: wall 10.0 s") and "training 25%" in titles[0]
    assert "sampling 50%" in titles[0]
    assert "training 80%" in titles[1]
    assert titles[2] == "empty: no spans"
    # Trainer on top: categories draw bottom-up, so it is last.
    assert list(figure.layout.yaxis.categoryarray) == [replica_lane(10), G1, G0, TRAINER_LANE]
    assert figure.layout.barmode == "overlay"


def test_bars_start_and_last_where_the_spans_do():
    timeline = _timeline()
    timeline.add(G0, SAMPLING, 1.0, 1.5)
    timeline.add(G0, SAMPLING, 3.0, 4.0)
    (trace,) = timeline_figure([("run", timeline)]).data
    assert list(trace.base) == [1.0, 3.0]
    assert list(trace.x) == [0.5, 1.0]
    assert list(trace.y) == [G0, G0]


def test_many_spans_render_as_few_traces():
    timeline = _timeline(gap=0.0)
    for i in range(5000):
        timeline.add(replica_lane(i % 4), SAMPLING, 0.05 * i, 0.05 * i + 0.02)
    figure = timeline_figure([("big", timeline)])
    assert len(figure.data) == 1 and len(figure.data[0].x) == 5000


def test_no_runs_gives_an_empty_figure():
    assert len(timeline_figure([]).data) == 0


def test_lane_order_puts_the_trainer_first():
    spans = [Span(name, SAMPLING, 0.0, 1.0) for name in ("generator 10", "trainer", "generator 2")]
    assert lane_order(spans) == ["trainer", "generator 2", "generator 10"]
