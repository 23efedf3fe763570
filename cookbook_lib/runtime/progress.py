"""Progress on every long wait: a bar in a notebook, a line in a terminal, nothing in logs or tests.

A GRPO step on a CPU takes minutes; without progress a notebook looks hung. Every wait the library
knows will be long (converting the embedded model, the warm-start, the episodes of a step, the
optimizer step, validation, a checkpoint) goes through :func:`progress_bar` or
:class:`LiveProgress`, which use ``tqdm.auto``: an ipywidgets bar in Jupyter and Colab, a
self-rewriting line on a terminal. Bars are transient (``leave=False``): they vanish when their
wait ends, so a run's output stays one line per step.

``COOKBOOK_PROGRESS`` decides whether bars show: ``1`` always, ``0`` never, ``auto`` (the default)
in a notebook and when stderr is a terminal, so a log file or a test run gets no bar at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

PROGRESS_ENV = "COOKBOOK_PROGRESS"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# How often a live bar re-reads its counters (tokens sampled): a 2-minute wait moves every second.
TICK_S = 1.0


def in_notebook() -> bool:
    """Whether bars are notebook widgets: ``tqdm.auto`` picked its notebook flavour at import."""
    return any(base.__module__ == "tqdm.notebook" for base in tqdm.__mro__)


def progress_enabled() -> bool:
    """Whether progress bars show now (see the module's docstring for ``COOKBOOK_PROGRESS``)."""
    setting = os.environ.get(PROGRESS_ENV, "auto").strip().lower()
    if setting in _ON:
        return True
    if setting in _OFF:
        return False
    if setting not in ("", "auto"):
        raise ValueError(
            f"{PROGRESS_ENV}={setting!r} is not a setting: use 1 (always show progress), 0 (never) "
            "or auto (in notebooks and terminals)"
        )
    if in_notebook():
        return True
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def progress_bar(
    desc: str,
    total: float | None = None,
    *,
    unit: str = "it",
    iterable: Iterable[Any] | None = None,
    leave: bool = False,
    show: bool = True,
) -> tqdm:
    """A ``tqdm.auto`` bar, or a silent stand-in when progress is off; use it as a context manager.

    The stand-in is tqdm's own disabled bar, so ``update``, ``set_postfix_str`` and iteration work
    the same either way and callers need no ``if``; ``show=False`` asks for the stand-in. Iterating
    over the bar (``iterable=``) closes it at the end of the loop. ``leave=False``: the bar
    disappears when closed.
    """
    if total is None and isinstance(iterable, Sequence):
        total = len(iterable)
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        leave=leave,
        disable=not (show and progress_enabled()),
        dynamic_ncols=True,
        mininterval=0.5,
    )


class LiveProgress:
    """A bar of things done out of a fixed total, with a status that updates by itself.

    ``status()`` (e.g. the tokens sampled so far, read from the generators) is re-read every
    ``TICK_S`` seconds by a task on the running event loop, so the bar moves while a long batch of
    episodes decodes, not only when an episode finishes. Use it as ``async with``::

        async with LiveProgress("step 3 sampling", 16, unit="episode", status=tokens) as live:
            ... live.done()  # once per finished episode
    """

    def __init__(
        self,
        desc: str,
        total: int,
        *,
        unit: str = "it",
        status: Callable[[], str] | None = None,
        show: bool = True,
    ) -> None:
        self.desc, self.total, self.unit, self.status, self.show = desc, total, unit, status, show
        self.bar: tqdm | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LiveProgress:
        self.bar = progress_bar(self.desc, self.total, unit=self.unit, show=self.show)
        self._refresh_status()
        if not self.bar.disable and self.status is not None:
            self._ticker = asyncio.create_task(self._tick(), name=f"progress-{self.desc}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self.bar is not None:
            self._refresh_status()
            self.bar.close()

    def done(self, count: int = 1) -> None:
        """``count`` more things finished."""
        if self.bar is not None:
            self.bar.update(count)

    def _refresh_status(self) -> None:
        if self.bar is not None and self.status is not None and not self.bar.disable:
            self.bar.set_postfix_str(self.status())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._refresh_status()


def tokens_sampled(generators: Iterable[object]) -> int:
    """Tokens sampled so far by ``generators`` (those that keep ``GeneratorStats``; others add 0)."""
    return sum(int(getattr(getattr(g, "stats", None), "tokens_sampled", 0)) for g in generators)


def tokens_status(generators: Sequence[object]) -> Callable[[], str]:
    """A :class:`LiveProgress` status: the tokens ``generators`` sampled since this was called."""
    start = tokens_sampled(generators)
    return lambda: f"{tokens_sampled(generators) - start:,} tokens sampled"
