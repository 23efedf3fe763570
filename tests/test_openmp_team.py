"""Letting go of a thread's idle OpenMP team (runtime/openmp_team.py)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.openmp_team import _loaded_runtime, _pause_function, release_openmp_team
from cookbook_lib.runtime.own_thread import run_in_own_thread

# sentencepiece's wheel maps a libgomp of its own, before torch's in /proc/self/maps (as in the
# full suite): the runtime paused must still be torch's.
with contextlib.suppress(ImportError):
    import sentencepiece  # noqa: F401

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _pause_function() is None or torch.get_num_threads() < 2,
    reason="needs Linux, an OpenMP runtime with omp_pause_resource_all and 2 torch threads",
)


def _threads() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")}


def _build_team() -> set[int]:
    """Run a parallel op on this thread; the helper threads its new OpenMP team started."""
    before = _threads()
    x = torch.randn(1024, 1024)
    (x @ x).sum()
    torch.ones(4_000_000).mul_(2)  # an elementwise op past torch's grain size: a parallel region
    team = _threads() - before
    assert team, "a parallel op on a 2-thread torch started no OpenMP helper thread"
    return team


def _in_fresh_thread(function):
    """``function()`` in a thread of its own, so this test leaves the main thread's team alone."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = function()
        except BaseException as exc:  # re-raised here, with its own message
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def test_the_runtime_paused_is_torchs_own_when_torch_ships_one():
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    shipped = [p for p in torch_lib.iterdir() if p.name.startswith(("libgomp", "libomp", "libiomp5"))]
    if not shipped:
        pytest.skip("this torch build links the environment's OpenMP runtime")
    assert _loaded_runtime().resolve().parent == torch_lib


def test_releasing_ends_the_calling_threads_team_and_a_later_op_builds_another():
    def scenario() -> tuple[bool, set[int], set[int], set[int]]:
        team = _build_team()
        released = release_openmp_team()
        after = _threads()
        return released, team, after, _build_team()

    released, team, after, second_team = _in_fresh_thread(scenario)
    assert released
    assert not team & after  # its helper threads exited
    assert second_team  # and the next parallel op works, with a new team


def test_a_generators_caller_lets_go_of_its_team(sharp_model, tokenizer, prompts):
    generator = HFGenerator(sharp_model, pad_token_id=tokenizer.pad_token_id)

    def scenario() -> tuple[set[int], set[int]]:
        team = _build_team()

        async def sample() -> None:
            async with generator:
                await generator.sample(prompts[0], SamplingParams(temperature=0.0, max_tokens=2))

        run_sync(sample())
        return team, _threads()

    team, after = _in_fresh_thread(scenario)
    assert not team & after


def test_the_caller_of_run_in_own_thread_lets_go_of_its_team():
    # The SFT warm-start runs in its own thread while the caller, whose team the model's loading
    # built, only waits: left alone, that team kept the warm-start's threads from spin-waiting
    # (13% system time in the demo's warm-start).
    def scenario() -> tuple[set[int], set[int]]:
        team = _build_team()
        inside = run_in_own_thread(lambda stop: _threads(), name="job")
        return team, inside

    team, inside = _in_fresh_thread(scenario)
    assert not team & inside  # gone before the job's thread ran
