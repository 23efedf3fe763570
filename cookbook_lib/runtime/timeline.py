"""A run's timeline: when each part of the system was busy, and with what, as spans on lanes.

A *lane* is one worker: the trainer, or one generator replica. A *kind* is what it was doing:
sampling, stepping an environment, training, syncing weights, validating, waiting. The async GRPO
loop records spans from wherever the work happens (generator worker threads, the asyncio loop,
the trainer), and :mod:`cookbook_lib.display.timeline_plots` draws lockstep and async runs one above the
other, which shows where each leaves the GPU idle.

Spans are kept as a union per (lane, kind), not one record per event: many concurrent episodes
step their environments at once on one lane, and a generator reports every ~30 ms decode step, so
overlapping spans, and spans closer than ``merge_gap_s``, are merged as they arrive. That keeps a
long run's memory and its ``timeline.jsonl`` small; the cost is that gaps up to ``merge_gap_s``
count as busy.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.envs.wrappers import EnvWrapper
from cookbook_lib.rollout.play import EnvFactory
from cookbook_lib.types import Message

if TYPE_CHECKING:
    # Not imported at run time: cookbook_lib.generators loads torch, which a timeline does not need.
    from cookbook_lib.generators.stats import StepInfo

# Kinds of work.
SAMPLING = "sampling"
ENV = "env"
TRAINING = "training"
WEIGHT_SYNC = "weight_sync"
VALIDATION = "validation"
WAITING = "waiting"
KINDS: tuple[str, ...] = (SAMPLING, ENV, TRAINING, WEIGHT_SYNC, VALIDATION, WAITING)

# Lanes.
TRAINER_LANE = "trainer"
GENERATOR_LANE_PREFIX = "generator "

FORMAT_VERSION = 1
# A per-(lane, kind) list is re-merged once it has grown to twice its size after the last merge,
# so spans arriving out of order (concurrent episodes end in any order) cost amortized O(log n).
_COMPACT_MIN = 256


def replica_lane(index: int) -> str:
    """The lane of generator replica ``index``."""
    return f"{GENERATOR_LANE_PREFIX}{index}"


def is_generator_lane(lane: str) -> bool:
    return lane.startswith(GENERATOR_LANE_PREFIX)


@dataclass(frozen=True)
class Span:
    """One interval of one kind of work on one lane, in seconds since the timeline's origin."""

    lane: str
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval], gap: float = 0.0) -> list[Interval]:
    """The union of ``intervals``, sorted, with intervals at most ``gap`` apart joined into one."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + gap:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def run_window(spans: Iterable[Span]) -> Interval:
    """The (start, end) a run covers: from its origin (or an earlier span) to the last span's end.

    ``(0.0, 0.0)`` without spans. The origin counts even before the first span, because the time
    from the start of a run to its first span (loading, the first prefill) is part of its wall time.
    """
    spans = list(spans)
    if not spans:
        return 0.0, 0.0
    start = min(0.0, min(span.start for span in spans))
    return start, max(start, max(span.end for span in spans))


def busy_seconds(
    spans: Iterable[Span],
    lane: str,
    kind: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> float:
    """Seconds ``lane`` was busy with ``kind`` (any kind if None) within [start, end], if given.

    Spans of different kinds on one lane may overlap (a weight sync during sampling); their union
    is counted, so no second counts twice.
    """
    low = -math.inf if start is None else start
    high = math.inf if end is None else end
    clipped = (
        (max(span.start, low), min(span.end, high))
        for span in spans
        if span.lane == lane and (kind is None or span.kind == kind)
    )
    return sum(e - s for s, e in merge_intervals((s, e) for s, e in clipped if e > s))


def busy_fraction_of(
    spans: Sequence[Span],
    lane: str,
    kind: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> float:
    """:func:`busy_seconds` over the window's length; the window defaults to :func:`run_window`.

    NaN for an empty window (no spans yet): a fraction of nothing is not 0% busy.
    """
    window_start, window_end = run_window(spans)
    low = window_start if start is None else start
    high = window_end if end is None else end
    if high <= low:
        return math.nan
    return busy_seconds(spans, lane, kind, low, high) / (high - low)


@dataclass
class _Intervals:
    """The spans of one (lane, kind): partly merged as they arrive, fully by ``_compact``."""

    items: list[Interval]
    compact_at: int = _COMPACT_MIN


class Timeline:
    """Spans of work on lanes, recorded from any thread; see the module docstring.

    ``origin`` is a ``time.perf_counter()`` value (now by default): ``add`` takes perf_counter
    times and stores seconds since ``origin``. Build the timeline when the run starts, so a span's
    ``start`` reads as "seconds into the run".
    """

    def __init__(self, origin: float | None = None, merge_gap_s: float = 0.01) -> None:
        if merge_gap_s < 0:
            raise ValueError(f"merge_gap_s must be at least 0, got {merge_gap_s}")
        now_perf, now_unix = time.perf_counter(), time.time()
        self.origin = now_perf if origin is None else origin
        self.origin_unix = now_unix - (now_perf - self.origin)  # for matching against logs
        self.merge_gap_s = merge_gap_s
        self._lock = threading.Lock()
        self._intervals: dict[tuple[str, str], _Intervals] = {}
        self._lanes: dict[str, None] = {}  # an ordered set: lanes in first-recorded order

    def add(self, lane: str, kind: str, start: float, end: float) -> None:
        """Record that ``lane`` did ``kind`` from ``start`` to ``end`` (``time.perf_counter()`` values)."""
        if end < start:
            raise ValueError(f"a span cannot end before it starts: {start} > {end} ({lane}, {kind})")
        self._add_relative(lane, kind, start - self.origin, end - self.origin)

    def _add_relative(self, lane: str, kind: str, start: float, end: float) -> None:
        gap = self.merge_gap_s
        with self._lock:
            intervals = self._intervals.get((lane, kind))
            if intervals is None:
                intervals = self._intervals[(lane, kind)] = _Intervals([])
                self._lanes.setdefault(lane)
            items = intervals.items
            if items:
                # Joining with the last one merges the common case (spans arriving in order) at
                # once. It is right for any order: two spans within the gap end up in one merged
                # span whatever else arrives.
                last_start, last_end = items[-1]
                if start <= last_end + gap and end >= last_start - gap:
                    items[-1] = (min(start, last_start), max(end, last_end))
                    return
            items.append((start, end))
            if len(items) >= intervals.compact_at:
                self._compact(intervals)

    def _compact(self, intervals: _Intervals) -> None:
        intervals.items = merge_intervals(intervals.items, self.merge_gap_s)
        intervals.compact_at = max(2 * len(intervals.items), _COMPACT_MIN)

    @contextmanager
    def span(self, lane: str, kind: str) -> Iterator[None]:
        """Record the time spent in the ``with`` block, also when it raises or is cancelled.

        A plain ``with`` works around ``await`` too: it only reads the clock on entry and exit.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, kind, start, time.perf_counter())

    def spans(self) -> list[Span]:
        """The merged spans, sorted by (lane, start)."""
        with self._lock:
            merged = []
            for (lane, kind), intervals in self._intervals.items():
                self._compact(intervals)
                merged.extend(Span(lane, kind, start, end) for start, end in intervals.items)
        return sorted(merged, key=lambda s: (s.lane, s.start, s.kind, s.end))

    def lanes(self) -> list[str]:
        """Lanes in the order their first span was recorded."""
        with self._lock:
            return list(self._lanes)

    def wall_s(self) -> float:
        """Seconds from the origin to the end of the last span (0 without spans)."""
        start, end = run_window(self.spans())
        return end - start

    def busy_s(
        self, lane: str, kind: str | None = None, start: float | None = None, end: float | None = None
    ) -> float:
        """Seconds ``lane`` was busy (with ``kind``, or any kind), within [start, end] if given.

        ``start`` and ``end`` are seconds since the origin, like a span's.
        """
        return busy_seconds(self.spans(), lane, kind, start, end)

    def busy_fraction(
        self, lane: str, kind: str | None = None, start: float | None = None, end: float | None = None
    ) -> float:
        """``busy_s`` over the window's length; the window defaults to the origin to the last span's end.

        NaN for an empty window.
        """
        return busy_fraction_of(self.spans(), lane, kind, start, end)

    def save(self, path: str | Path) -> None:
        """Write the merged spans as JSONL: a header line, then one span per line.

        Written to a temporary file and renamed, so a notebook reading it during a run never sees
        half a file.
        """
        path = Path(path)
        header = {
            "timeline_format": FORMAT_VERSION,
            "origin_unix": self.origin_unix,
            "merge_gap_s": self.merge_gap_s,
            "lanes": self.lanes(),
        }
        lines = [json.dumps(header)]
        lines.extend(
            json.dumps({"lane": s.lane, "kind": s.kind, "start": s.start, "end": s.end}) for s in self.spans()
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("\n".join(lines) + "\n")
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        """Read a file written by :meth:`save`. Its ``origin`` is 0: spans keep their saved times."""
        with open(path) as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        if not records or records[0].get("timeline_format") != FORMAT_VERSION:
            raise ValueError(f"{path} is not a timeline file (format {FORMAT_VERSION})")
        header = records[0]
        timeline = cls(origin=0.0, merge_gap_s=float(header["merge_gap_s"]))
        timeline.origin_unix = float(header["origin_unix"])
        # Lanes first, from the header, so their order survives the sorted span lines.
        timeline._lanes = dict.fromkeys(header["lanes"])
        for record in records[1:]:
            timeline._add_relative(record["lane"], record["kind"], record["start"], record["end"])
        return timeline


class TimedEnv(EnvWrapper):
    """An :class:`Env` whose ``reset`` and ``step`` are recorded as ``ENV`` spans on ``lane``.

    Everything else is passed through (:class:`~cookbook_lib.envs.wrappers.EnvWrapper`), so
    ``run_episode``'s "closed exactly once" holds for the wrapped env too.
    """

    def __init__(self, env: Env, timeline: Timeline, lane: str) -> None:
        super().__init__(env)
        self.timeline = timeline
        self.lane = lane

    async def reset(self, task: Task) -> list[Message]:
        with self.timeline.span(self.lane, ENV):
            return await super().reset(task)

    async def step(self, message: Message) -> StepResult:
        with self.timeline.span(self.lane, ENV):
            return await super().step(message)


def timed_env_factory(env_factory: EnvFactory, timeline: Timeline, lane: str) -> EnvFactory:
    """``env_factory`` with each env it builds wrapped in a :class:`TimedEnv` recording on ``lane``."""

    def build(task: Task) -> Env:
        return TimedEnv(env_factory(task), timeline, lane)

    return build


def generator_step_recorder(timeline: Timeline, lane: str) -> Callable[[StepInfo], None]:
    """A ``step_callback`` for ``HFGenerator``: each forward pass (prefill or decode) as ``SAMPLING``.

    It runs on the generator's worker thread, which ``Timeline.add`` allows.
    """

    def record(step: StepInfo) -> None:
        timeline.add(lane, SAMPLING, step.start_s, step.end_s)

    return record
