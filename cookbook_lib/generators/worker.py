"""``WorkerGenerator``: the protocol both backends share between the event loop and the one thread
that owns the model (or the vLLM engine).

Callers on the event loop put requests and controls (weight updates, vLLM's sleep and wake) into
two queues under one condition; the worker, started on the first submission, loops: wait for
work, take the controls and the requests it may admit, drop what was cancelled, apply the
controls, admit, run one step, until the generator closes. A control that must wait for the
running requests to finish (``between_requests``) drains them first: nothing new is admitted
until it is applied, so every sample runs under one version. A crash of the worker fails every
waiting and running request instead of leaving callers hanging.

Subclasses say what a step is (``_admit``, ``_step``, ``_apply_control``, ``_drop_cancelled``,
``_take_requests``, ``_is_busy``, ``_fail_running``); this module knows nothing about models.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from cookbook_lib.generators.base import Generator, GeneratorClosedError
from cookbook_lib.generators.handoff import WorkerCall, deliver

Result = TypeVar("Result")

logger = logging.getLogger(__name__)


class WorkerGenerator(Generator, abc.ABC):
    """A :class:`Generator` whose model is touched by one worker thread only."""

    _worker_name: ClassVar[str] = "generator"
    """The worker thread's name."""
    _failure: ClassVar[str] = "the generator worker crashed"
    """What callers are told when the worker fails (followed by the exception)."""

    def _init_worker(self) -> None:
        self._version = 0  # the policy version of the weights the worker holds
        # Shared between the event loop and the worker, guarded by _wake.
        self._wake = threading.Condition()
        self._queue: deque[Any] = deque()
        self._controls: deque[Any] = deque()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def num_pending(self) -> int:
        """Requests waiting to be admitted."""
        return len(self._queue)

    # ---- the caller's side ---------------------------------------------------------------------

    def _submit(self, queue: deque[Any], item: Any) -> None:
        with self._wake:
            if self._closed:
                raise GeneratorClosedError("the generator is closed")
            queue.append(item)
            if self._thread is None:
                # Started lazily: a generator built and never used holds no thread.
                self._thread = threading.Thread(target=self._work, name=self._worker_name, daemon=True)
                self._thread.start()
            self._wake.notify()

    async def run_on_worker(self, function: Callable[[], Result]) -> Result:
        """Run ``function`` on the worker thread once no request is running; its result.

        Why: on a CPU, each thread that runs torch ops owns an OpenMP team, and with more
        OpenMP threads than cores libgomp stops spin-waiting between parallel regions, which
        cost every decode step and every training step ~25 % on 2 cores (``bench/bench_threads.py``,
        docs/benchmarks.md). A lockstep run trains on the generator's thread, so one team does all.
        Requests that arrive meanwhile wait, as they do for a weight update between requests.
        """
        loop = asyncio.get_running_loop()
        call = WorkerCall(function, loop.create_future(), loop)
        self._submit(self._controls, call)
        return await call.future

    def _withdraw(self, request: Any) -> None:
        """A cancelled caller's request: marked, and out of the queue if it is still there."""
        with self._wake:
            request.cancelled = True
            if request in self._queue:
                self._queue.remove(request)
            self._wake.notify()

    def _shut(self, error: GeneratorClosedError) -> None:
        """Refuse new work and fail what waits in the queues (not the running requests) with ``error``."""
        with self._wake:
            self._closed = True
            waiting = [*self._queue, *self._controls]
            self._queue.clear()
            self._controls.clear()
            self._wake.notify_all()
        for item in waiting:
            deliver(item.future, item.loop, error)

    async def _stop_worker(self) -> None:
        """Close, then wait for the worker to finish its step, fail its running requests and exit."""
        self._shut(GeneratorClosedError("the generator was closed"))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # ---- the worker thread ---------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (
                        self._closed or self._queue or self._controls or self._is_busy() or self._has_chores()
                    ):
                        self._wake.wait()
                    if self._closed:
                        return
                    if self._is_busy() and any(c.between_requests for c in self._controls):
                        # Drain: the running requests finish under the current weights, and
                        # nothing new starts until the control is applied.
                        controls, admitted = [], []
                    else:
                        controls = list(self._controls)
                        self._controls.clear()
                        admitted = self._take_requests()
                self._drop_cancelled()
                # Controls apply only here, between two steps: tokens sampled before this point
                # carry the old version, tokens after it the new one.
                for control in controls:
                    if isinstance(control, WorkerCall):
                        self._run_call(control)
                    else:
                        self._apply_control(control)
                if admitted:
                    self._admit(admitted)
                if self._is_busy():
                    self._step()
        except BaseException as exc:  # a bug or a failed engine: fail everything rather than hang callers
            logger.exception("%s worker crashed", self._worker_name)
            self._shut(GeneratorClosedError(f"{self._failure}: {exc!r}"))
        finally:
            self._fail_running(GeneratorClosedError("the generator was closed"))

    @staticmethod
    def _run_call(call: WorkerCall) -> None:
        """Run a ``run_on_worker`` function; what it raises goes to its caller, not the worker."""
        try:
            outcome = call.function()
        except Exception as exc:  # the caller's error: it fails the caller, the worker goes on
            outcome = exc
        deliver(call.future, call.loop, outcome)

    def _take_requests(self) -> list[Any]:
        """The queued requests to admit now, popped from ``_queue`` (called with the lock held)."""
        taken = [request for request in self._queue if not request.cancelled]
        self._queue.clear()
        return taken

    @abc.abstractmethod
    def _is_busy(self) -> bool:
        """Whether requests are running (read with the lock held, on the worker)."""

    def _has_chores(self) -> bool:
        """Whether the worker has bookkeeping to do before it sleeps (read with the lock held)."""
        return False

    @abc.abstractmethod
    def _drop_cancelled(self) -> None:
        """Stop the running requests whose callers cancelled, and do the worker's chores."""

    @abc.abstractmethod
    def _apply_control(self, control: Any) -> None:
        """Apply one control (a weight update, ...) and resolve its future."""

    @abc.abstractmethod
    def _admit(self, requests: list[Any]) -> None:
        """Start ``requests``."""

    @abc.abstractmethod
    def _step(self) -> None:
        """One step of every running request; deliver the finished ones."""

    @abc.abstractmethod
    def _fail_running(self, error: GeneratorClosedError) -> None:
        """The worker is exiting: fail every running request with ``error`` and free what it holds."""
