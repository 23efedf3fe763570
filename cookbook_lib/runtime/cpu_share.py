"""Fitting torch's CPU threads to the cores other processes leave free, while a run computes.

Why: torch's OpenMP runs every op on a team of one thread per core, and the team's threads meet at
a barrier after each op. On a shared machine (a workshop laptop running a browser beside the
kernel, a Colab VM with 2 vCPUs, an evaluation beside a training run) one of those threads is often
descheduled for the other process, and its partner spins at the barrier, holding a core, until it
comes back: an evaluation beside a training process took 3.6-5.7x its time alone on 2 cores, where a
fair share of the CPU would cost 2x (``bench/bench_contention.py``, docs/benchmarks.md). OpenMP's
own remedies must be set before torch loads, and measured worse: ``OMP_WAIT_POLICY=PASSIVE`` costs
~20% alone (1.42x beside), a short ``GOMP_SPINCOUNT`` still leaves 2.9x beside; fitted, 1.84x and
nothing alone.

So the compute threads (the generator's worker, the trainer) call :func:`fit_threads` between
their steps: at most once a second it reads how busy this process's cores were (``/proc/stat``)
and how much of that was this process (``/proc/self/stat``); the rest is other processes' work,
and the team shrinks to the cores they leave free, never below one thread nor above the number
torch started with (or the user set). A process alone keeps its full team; two such processes
beside each other settle on a core each. A new count takes effect only after two readings agree,
so a short burst next door does not resize the team.

Off where ``COOKBOOK_FIT_THREADS=0`` is set, and where there is no ``/proc`` (macOS, Windows): the
thread count then stays as torch or the user set it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_SWITCH = "COOKBOOK_FIT_THREADS"
MEASURE_EVERY_S = 1.0


@dataclass(frozen=True)
class CpuReading:
    """Busy time so far of this process's cores and of this process itself, in clock ticks."""

    cores_busy_ticks: int
    own_ticks: int


def _allowed_cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_proc(cores: set[int]) -> CpuReading | None:
    """The busy ticks of ``cores`` (``/proc/stat``) and of this process (``/proc/self/stat``).

    None where ``/proc`` cannot be read. Busy is user, nice, system, irq and softirq time; idle,
    iowait and steal (the hypervisor's) are not work another process did on these cores.
    """
    try:
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
        with open("/proc/self/stat") as own:
            # The command name (field 2) may hold spaces: the fields that follow start after ")".
            own_fields = own.read().rpartition(")")[2].split()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in rest.split()[:7])
        busy += user + nice + system + irq + softirq
    # utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the ")".
    own_ticks = int(own_fields[11]) + int(own_fields[12])
    return CpuReading(busy, own_ticks)


class ThreadFitter:
    """Decides how many threads torch should use now, from readings a second or more apart."""

    def __init__(
        self,
        max_threads: int,
        cores: set[int] | None = None,
        reader: Callable[[set[int]], CpuReading | None] = read_proc,
        ticks_per_s: float | None = None,
        every_s: float = MEASURE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.cores = cores if cores is not None else _allowed_cores()
        self._reader = reader
        self._ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_at = clock()
        self._last: CpuReading | None = reader(self.cores)
        self._threads = max_threads
        self._proposed: int | None = None
        self.others_busy_cores = 0.0
        """Cores' worth of other processes' work in the last interval measured."""

    @property
    def works(self) -> bool:
        """Whether readings can be taken here (``/proc`` exists)."""
        return self._last is not None

    def threads(self) -> int:
        """The thread count for now; re-measured when a second or more has passed since the last."""
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last_at < self._every_s:
                return self._threads
            reading = self._reader(self.cores)
            if reading is None:
                return self._threads
            previous, self._last = self._last, reading
            elapsed_ticks = max(now - self._last_at, 1e-3) * self._ticks_per_s
            self._last_at = now
            others = (reading.cores_busy_ticks - previous.cores_busy_ticks) - (
                reading.own_ticks - previous.own_ticks
            )
            self.others_busy_cores = max(0.0, others / elapsed_ticks)
            # The cores the others leave free, to the nearest whole core (0.5 rounds up: a
            # browser's tick of work does not halve the team).
            free = math.floor(len(self.cores) - self.others_busy_cores + 0.5)
            wanted = max(1, min(self.max_threads, free))
            if wanted == self._threads:
                self._proposed = None
            elif wanted == self._proposed:  # two readings in a row agree
                self._threads, self._proposed = wanted, None
            else:
                self._proposed = wanted
            return self._threads


_fitter: ThreadFitter | None = None
_fitter_lock = threading.Lock()


def _process_fitter() -> ThreadFitter | None:
    """The process's one fitter, made on first use; None where fitting is off or cannot work."""
    global _fitter
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    with _fitter_lock:
        if _fitter is None:
            # The ceiling is the count torch runs with when the first compute thread asks:
            # torch's default (the cores) or what the user set.
            _fitter = ThreadFitter(max_threads=torch.get_num_threads())
    return _fitter if _fitter.works else None


def fit_threads(device: torch.device) -> int:
    """Size the calling thread's torch team to the free cores (CPU devices only); the count it uses.

    Cheap enough to call before every decode step and micro-batch: it re-measures once a second.
    torch's thread count is per thread (OpenMP's), so each compute thread calls this for itself.
    """
    if device.type != "cpu" or (fitter := _process_fitter()) is None:
        return torch.get_num_threads()
    wanted = fitter.threads()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return wanted
