"""Where a run's torch work runs: the generator's worker for lockstep training, a thread of its own
for the warm-start (one OpenMP team at a time; bench/bench_threads.py says why)."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.grpo.weight_sync import GeneratorReplicas
from cookbook_lib.runtime.own_thread import run_in_own_thread


def test_run_on_worker_runs_between_requests_and_hands_back_results_and_errors(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer

    async def scenario() -> None:
        generator = HFGenerator(model, pad_token_id=tokenizer.pad_token_id)
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0)
            sampling = asyncio.ensure_future(generator.sample(tokenizer.encode("Hi there"), params))
            await asyncio.sleep(0)
            # Runs on the worker thread, between two decode steps with no request running.
            name = await generator.run_on_worker(lambda: threading.current_thread().name)
            assert name == HFGenerator._worker_name
            assert len((await sampling).tokens) == 4
            with pytest.raises(ZeroDivisionError):
                await generator.run_on_worker(lambda: 1 / 0)
            # The caller's error did not stop the worker.
            result = await generator.sample(tokenizer.encode("Hi there"), params)
            assert len(result.tokens) == 4
            replicas = GeneratorReplicas([generator])
            assert await replicas.run_compute(lambda: threading.current_thread().name) == name
        finally:
            await generator.close()

    asyncio.run(scenario())


def test_compute_runs_here_with_more_than_one_replica(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer

    async def scenario() -> None:
        generators = [HFGenerator(model, pad_token_id=tokenizer.pad_token_id) for _ in range(2)]
        replicas = GeneratorReplicas(generators)
        try:
            here = threading.current_thread().name
            assert await replicas.run_compute(lambda: threading.current_thread().name) == here
        finally:
            for generator in generators:
                await generator.close()

    asyncio.run(scenario())


def test_own_thread_returns_raises_and_stops_when_asked():
    assert run_in_own_thread(lambda stop: threading.current_thread().name, name="job") == "job"
    with pytest.raises(ValueError, match="bad"):
        run_in_own_thread(lambda stop: (_ for _ in ()).throw(ValueError("bad")), name="job")

    seen: list[bool] = []

    def job(stop: threading.Event) -> None:
        seen.append(stop.wait(timeout=5))

    # An interrupt in the caller sets `stop`; the job sees it, ends, and the interrupt propagates.
    # Python's own SIGINT handler for the test: a process started in the background by a shell
    # inherits SIGINT ignored, and interrupt_main() then does nothing (a CI run started that way
    # failed here).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.3, lambda: __import__("_thread").interrupt_main())
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            run_in_own_thread(job, name="job")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [True]
