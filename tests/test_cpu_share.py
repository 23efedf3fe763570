"""Fitting torch's threads to the free cores of a shared CPU (``runtime.cpu_share``)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch
from sft_sequences import two_sft_sequences

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.runtime import cpu_share
from cookbook_lib.runtime.cpu_share import CpuReading, ThreadFitter, fit_threads, read_proc

TICKS = 100.0  # clock ticks a second in the scripted readings


class ScriptedCpu:
    """Readings one second apart, each adding ``others_cores`` and ``own_cores`` worth of busy ticks."""

    def __init__(self) -> None:
        self.at_s, self.busy, self.own = 0.0, 0, 0
        self.others_cores, self.own_cores = 0.0, 2.0
        self.readable = True

    def __call__(self, cores: set[int]) -> CpuReading | None:
        if not self.readable:
            return None
        # The second since the last reading, at the rates set now.
        self.at_s += 1.0
        self.busy += int((self.others_cores + self.own_cores) * TICKS)
        self.own += int(self.own_cores * TICKS)
        return CpuReading(self.busy, self.own)

    def clock(self) -> float:
        return self.at_s


def _fitter(cpu: ScriptedCpu, max_threads: int = 2) -> ThreadFitter:
    return ThreadFitter(
        max_threads, cores={0, 1}, reader=cpu, ticks_per_s=TICKS, every_s=0.0, clock=cpu.clock
    )


def test_a_process_alone_keeps_its_threads_and_beside_a_busy_one_shrinks_to_the_free_core():
    cpu = ScriptedCpu()
    fitter = _fitter(cpu)
    assert [fitter.threads() for _ in range(3)] == [2, 2, 2]
    # Another process takes a core: the first reading proposes 1, the second agrees.
    cpu.others_cores, cpu.own_cores = 1.0, 1.0
    assert fitter.threads() == 2
    assert fitter.others_busy_cores == pytest.approx(1.0)
    assert [fitter.threads() for _ in range(3)] == [1, 1, 1]
    # It ends: back to both cores, again after two readings.
    cpu.others_cores = 0.0
    assert [fitter.threads() for _ in range(3)] == [1, 2, 2]


def test_a_short_burst_or_a_light_neighbour_does_not_resize_the_team():
    cpu = ScriptedCpu()
    fitter = _fitter(cpu)
    cpu.others_cores = 1.0
    assert fitter.threads() == 2  # one reading proposes 1
    cpu.others_cores = 0.0
    assert [fitter.threads() for _ in range(3)] == [2, 2, 2]  # the next disagrees: nothing changed
    cpu.others_cores = 0.4  # a browser, a notebook server: under half a core
    assert [fitter.threads() for _ in range(4)] == [2, 2, 2, 2]
    cpu.others_cores = 1.5  # one and a half cores busy elsewhere still leaves one thread
    assert [fitter.threads() for _ in range(3)] == [2, 1, 1]
    cpu.others_cores = 2.0
    assert [fitter.threads() for _ in range(3)] == [1, 1, 1]  # never fewer than one


def test_the_ceiling_is_the_count_torch_started_with_and_unreadable_proc_changes_nothing():
    cpu = ScriptedCpu()
    one = _fitter(cpu, max_threads=1)
    assert [one.threads() for _ in range(3)] == [1, 1, 1]
    cpu.readable = False
    assert not ThreadFitter(2, cores={0, 1}, reader=cpu, every_s=0.0).works
    cpu.readable = True
    fitter = _fitter(cpu)
    cpu.others_cores, cpu.own_cores = 1.0, 1.0
    fitter.threads()
    cpu.readable = False  # the reading fails: the count stays as it was
    assert [fitter.threads() for _ in range(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="max_threads"):
        ThreadFitter(0, cores={0})


def test_threads_are_read_at_most_once_an_interval():
    cpu = ScriptedCpu()
    fitter = ThreadFitter(2, cores={0, 1}, reader=cpu, ticks_per_s=TICKS, every_s=3600.0, clock=lambda: 5.0)
    taken = cpu.at_s
    for _ in range(5):
        fitter.threads()
    assert cpu.at_s == taken  # no reading since the first


@pytest.mark.skipif(read_proc({0}) is None, reason="no /proc here")
def test_proc_readings_count_this_process_work():
    cores = cpu_share._allowed_cores()
    before = read_proc(cores)
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # 0.3 s of this process's CPU time
        pass
    after = read_proc(cores)
    assert before is not None and after is not None
    assert after.own_ticks - before.own_ticks >= 0.2 * cpu_share.os.sysconf("SC_CLK_TCK")
    # The cores were busy at least while this process was.
    assert after.cores_busy_ticks - before.cores_busy_ticks >= after.own_ticks - before.own_ticks - 2


@pytest.fixture
def busy_neighbour_fitter(monkeypatch):
    """The process's fitter, replaced by one that reads a neighbour busy on one of two cores."""
    cpu = ScriptedCpu()
    cpu.others_cores, cpu.own_cores = 1.0, 1.0
    monkeypatch.delenv(cpu_share.ENV_SWITCH, raising=False)
    monkeypatch.setattr(cpu_share, "_fitter", _fitter(cpu))
    started_with = torch.get_num_threads()
    yield cpu
    torch.set_num_threads(started_with)  # the count is also torch's default for new threads


def _in_a_thread(function):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", function()))
    thread.start()
    thread.join()
    return result["value"]


def test_fit_threads_sizes_the_calling_thread_on_cpus_only(busy_neighbour_fitter, monkeypatch):
    def fitted_three_times(device: str) -> tuple[int, list[int]]:
        before = torch.get_num_threads()
        fitted = [fit_threads(torch.device(device)) for _ in range(3)]
        assert torch.get_num_threads() == fitted[-1]
        return before, fitted

    torch.set_num_threads(2)
    assert _in_a_thread(lambda: fitted_three_times("cpu")) == (2, [2, 1, 1])
    torch.set_num_threads(2)
    # Not a CPU: the count is torch's, untouched.
    assert _in_a_thread(lambda: fitted_three_times("meta")) == (2, [2, 2, 2])
    monkeypatch.setenv(cpu_share.ENV_SWITCH, "0")  # switched off: untouched
    assert _in_a_thread(lambda: fitted_three_times("cpu")) == (2, [2, 2, 2])


def test_the_generator_and_the_trainer_fit_their_threads_between_steps(tiny_model_and_tokenizer, monkeypatch):
    model, tokenizer = tiny_model_and_tokenizer
    calls: list[tuple[str, torch.device]] = []

    def recording(device: torch.device) -> int:
        calls.append((threading.current_thread().name, device))
        return torch.get_num_threads()

    monkeypatch.setattr("cookbook_lib.generators.hf.fit_threads", recording)
    monkeypatch.setattr("cookbook_lib.grpo.trainer.fit_threads", recording)

    async def sample() -> None:
        async with HFGenerator(model, pad_token_id=tokenizer.pad_token_id) as generator:
            params = SamplingParams(max_tokens=4, temperature=0.0)
            await generator.sample(tokenizer.encode("Hi there"), params)

    asyncio.run(sample())
    # The prefill and each decode step, on the worker.
    assert len(calls) >= 4 and {name for name, _ in calls} == {HFGenerator._worker_name}
    assert {device.type for _, device in calls} == {"cpu"}
    calls.clear()
    trainer = PolicyTrainer(copy.deepcopy(model), pad_token_id=2, learning_rate=1e-5, micro_batch_tokens=16)
    trainer.sft_step(two_sft_sequences())  # two micro-batches: 12 tokens each, 16 a micro-batch
    assert len(calls) == 2 and {device.type for _, device in calls} == {"cpu"}
