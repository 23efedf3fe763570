"""The bf16-on-CPU probe: measured once per CPU, cached in a bounded file, and named in a run's first line."""

from __future__ import annotations

import json

import pytest
import torch

from cookbook_lib.runtime import cpu_probe, onednn_linear
from cookbook_lib.runtime.devices import AUTO_BF16_MIN_SPEEDUP, resolve_precision


def test_the_probe_measures_a_positive_ratio_and_caches_it(tmp_path, monkeypatch):
    first = cpu_probe.bf16_speedup(tmp_path)
    assert first > 0
    entries = json.loads((tmp_path / cpu_probe.PROBE_FILE).read_text())
    assert list(entries.values()) == [first]  # the measuring run returns what it stored

    def no_measuring() -> float:
        raise AssertionError("measured again although the ratio is cached")

    monkeypatch.setattr(cpu_probe, "measure_bf16_speedup", no_measuring)
    assert cpu_probe.bf16_speedup(tmp_path) == first


def test_the_bf16_probe_times_one_thread_and_gives_the_count_back(monkeypatch):
    seen: list[int] = []

    def timed(dtype: torch.dtype) -> float:
        seen.append(torch.get_num_threads())
        return 2.0 if dtype is torch.float32 else 0.5

    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_probe, "seconds_per_linear", timed)
    assert cpu_probe.measure_bf16_speedup() == 4.0
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_the_onednn_probe_has_its_own_entry(tmp_path):
    bf16 = cpu_probe.bf16_speedup(tmp_path)
    onednn = onednn_linear.onednn_linear_speedup(tmp_path)
    entries = json.loads((tmp_path / cpu_probe.PROBE_FILE).read_text())
    assert len(entries) == 2 and sorted(entries.values()) == sorted([bf16, onednn]) and onednn > 0


def test_a_ratio_far_below_one_keeps_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_probe, "measure_bf16_speedup", lambda: 0.020659336269793143)
    assert cpu_probe.bf16_speedup(tmp_path) == 0.0207
    assert json.loads((tmp_path / cpu_probe.PROBE_FILE).read_text()) == {
        next(iter(json.loads((tmp_path / cpu_probe.PROBE_FILE).read_text()))): 0.0207
    }


def test_the_cache_keeps_the_newest_entries_and_survives_a_bad_file(tmp_path, monkeypatch):
    path = tmp_path / cpu_probe.PROBE_FILE
    path.write_text("not json")
    monkeypatch.setattr(cpu_probe, "measure_bf16_speedup", lambda: 0.5)
    assert cpu_probe.bf16_speedup(tmp_path) == 0.5  # a corrupt file is measured over, not raised

    old = {f"cpu {i} | torch x | 2 threads": 1.0 for i in range(cpu_probe.MAX_ENTRIES + 5)}
    path.write_text(json.dumps(old))
    monkeypatch.setattr(cpu_probe, "cpu_model_name", lambda: "this cpu")
    assert cpu_probe.bf16_speedup(tmp_path) == 0.5
    entries = json.loads(path.read_text())
    assert len(entries) == cpu_probe.MAX_ENTRIES
    assert next(reversed(entries)).startswith("bf16 (1 thread): this cpu")  # the newest is kept


@pytest.mark.parametrize(("speedup", "says"), [(0.02, "lacks native bf16"), (4.4, "4.4x the float32 rate")])
def test_a_bf16_cpu_run_says_what_kind_of_cpu_it_is_on(monkeypatch, speedup, says):
    monkeypatch.setattr(cpu_probe, "bf16_speedup", lambda: speedup)
    assert says in resolve_precision("cpu", "bfloat16").describe()


def test_a_float32_cpu_run_pays_no_probe(monkeypatch):
    def probe() -> float:
        raise AssertionError("probed for a float32 run")

    monkeypatch.setattr(cpu_probe, "bf16_speedup", probe)
    line = resolve_precision("cpu", "float32").describe()
    assert "bf16" not in line and "auto" not in line
    monkeypatch.setenv("COOKBOOK_CPU_BF16", "0")  # auto switched off: no probe either
    assert torch.float32 is resolve_precision("cpu", "auto").sample_dtype


@pytest.mark.parametrize(
    ("speedup", "dtype", "says"),
    [
        (4.4, torch.bfloat16, "dtype auto: bf16 matmuls 4.4x the float32 rate on this CPU"),
        (2.0, torch.bfloat16, "2.0x the float32 rate"),
        (1.6, torch.float32, "dtype auto: float32, as bf16 matmuls run 1.6x its rate"),
        (0.0207, torch.float32, "run 0.021x its rate"),
    ],
)
def test_auto_on_a_cpu_picks_bf16_where_its_matmuls_measure_faster(monkeypatch, speedup, dtype, says):
    monkeypatch.delenv("COOKBOOK_CPU_BF16", raising=False)
    monkeypatch.setattr(cpu_probe, "bf16_speedup", lambda: speedup)
    precision = resolve_precision("cpu", "auto")
    assert precision.sample_dtype is dtype and precision.compute_dtype is dtype
    assert precision.master_dtype is torch.float32  # the trained weights and AdamW stay float32
    line = precision.describe()
    assert line.startswith(f"device cpu; sampling in {str(dtype)[6:]}") and says in line
    assert line.count("(") == 1  # one note: the auto choice's, not also the bf16 note


def test_auto_on_the_real_probe_agrees_with_the_measured_rate(monkeypatch, tmp_path):
    monkeypatch.delenv("COOKBOOK_CPU_BF16", raising=False)
    monkeypatch.setenv("COOKBOOK_CACHE_DIR", str(tmp_path))
    speedup = cpu_probe.bf16_speedup()
    expected = torch.bfloat16 if speedup >= AUTO_BF16_MIN_SPEEDUP else torch.float32
    assert resolve_precision("cpu", "auto").sample_dtype is expected
