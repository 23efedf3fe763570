"""Running a coroutine from sync code, also where an event loop is already running (Jupyter)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)``, or, inside a running loop (a notebook cell), the same on a thread.

    Notebooks can ``await`` the ``*_async`` functions directly; this lets the plain functions work
    there too, without patching the notebook's loop.

    A keyboard interrupt (a notebook's stop button) cancels the coroutine and waits until it has
    unwound (its ``finally`` blocks close environments and generators) before it propagates, so
    nothing keeps running behind the interrupted cell. ``asyncio.run`` does the same on its own.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}
    started, finished = threading.Event(), threading.Event()

    async def main() -> T:
        outcome["loop"], outcome["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        return await coroutine

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc
        finally:
            started.set()
            finished.set()

    # Waiting on our own event, not Thread.join: on Python 3.11 a join interrupted by
    # KeyboardInterrupt can mark a running thread as stopped, and a later join returns at once.
    worker = threading.Thread(target=target, name="cookbook-run-sync")
    worker.start()
    try:
        while not finished.wait(timeout=0.1):  # a timed wait lets KeyboardInterrupt reach this thread
            pass
    except KeyboardInterrupt:
        started.wait()
        if "task" in outcome:
            with contextlib.suppress(RuntimeError):  # the loop already finished and closed
                outcome["loop"].call_soon_threadsafe(outcome["task"].cancel)
        finished.wait()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
