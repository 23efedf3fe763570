"""Running a blocking torch computation in a thread of its own, which ends when it does.

Why: on a CPU each thread that runs torch ops keeps an OpenMP team for as long as it lives, and
once there are more OpenMP threads than cores libgomp stops spin-waiting between parallel regions:
every op of every thread then pays a wake-up (~25 % of a decode step on 2 cores,
``bench/bench_threads.py``). A run's warm-start therefore trains in a thread that exits before the
generator's worker starts, and the calling thread (a notebook's) keeps no team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from cookbook_lib.runtime.openmp_team import release_openmp_team

Result = TypeVar("Result")


def run_in_own_thread(function: Callable[[threading.Event], Result], name: str) -> Result:
    """``function(stop)`` in a new thread; its result, or what it raised, here.

    An interrupt here (Ctrl-C, a notebook's stop button) sets ``stop``, which ``function`` checks
    between its steps; then it waits for the thread to end and re-raises the interrupt.
    """
    stop, done = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = function(stop)
        except BaseException as exc:  # handed to the caller, which re-raises it
            outcome["error"] = exc
        finally:
            done.set()

    # The calling thread only waits from here on: its idle team (from the model's loading, say)
    # would make libgomp stop spin-waiting in the new thread's team.
    release_openmp_team()
    # Waiting on an event, not Thread.join: a join that an interrupt broke may not wait again.
    threading.Thread(target=target, name=name, daemon=True).start()
    try:
        while not done.wait(0.2):  # a timeout, so an interrupt reaches this thread at once
            pass
    except KeyboardInterrupt:
        stop.set()
        done.wait()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
