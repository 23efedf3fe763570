"""The bf16-on-CPU probe: measured once per CPU, cached in a bounded file, and named in a run's first line."""

from __future__ import annotations

import json

import pytest
import torch

from cookbook_lib.runtime import cpu_probe, onednn_linear
from cookbook_lib.runtime.devices import resolve_precision


def test_the_probe_measures_a_positive_ratio_and_caches_it(tmp_path, monkeypatch):
    first = cpu_probe.bf16_speedup(tmp_path)
    assert first > 0
    entries = json.loads((tmp_path / cpu_probe.PROBE_FILE).read_text())
    assert list(entries.values()) == [first]  # the measuring run returns what it stored

    def no_measuring() -> float:
        raise AssertionError("measured again although the ratio is cached")

    monkeypatch.setattr(cpu_probe, "measure_bf16_speedup", no_measuring)
    assert cpu_probe.bf16_speedup(tmp_path) == first


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
    assert next(reversed(entries)).startswith("bf16: this cpu")  # the newest is kept


@pytest.mark.parametrize(("speedup", "says"), [(0.02, "lacks native bf16"), (4.4, "4.4x the float32 rate")])
def test_a_bf16_cpu_run_says_what_kind_of_cpu_it_is_on(monkeypatch, speedup, says):
    monkeypatch.setattr(cpu_probe, "bf16_speedup", lambda: speedup)
    assert says in resolve_precision("cpu", "bfloat16").describe()


def test_a_float32_cpu_run_pays_no_probe(monkeypatch):
    def probe() -> float:
        raise AssertionError("probed for a float32 run")

    monkeypatch.setattr(cpu_probe, "bf16_speedup", probe)
    line = resolve_precision("cpu", "float32").describe()
    assert "bf16" not in line and torch.float32 is resolve_precision("cpu", "auto").sample_dtype
