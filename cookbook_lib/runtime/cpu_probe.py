"""How fast this CPU runs a matmul one way against another: short probes, cached per CPU.

Each ratio is against torch's float32 ``F.linear`` (MKL's sgemm on x86):

- :func:`bf16_speedup` (here): bfloat16 matmuls.
- ``onednn_linear.onednn_linear_speedup``: float32 through oneDNN, which sampling and training
  use where it is faster; it measures with :func:`fastest_seconds` and caches with
  :func:`cached_ratio`, both here.

A CPU with native bf16 (AVX512-BF16, AMX) runs bf16 matmuls several times its fp32 rate (4.4x
measured on a Xeon's two cores); one without emulates them, far slower: 0.02x measured on two
cores of an AMD EPYC (Zen 3, AVX2), where ``dtype="bfloat16"`` would make a run tens of times
slower. ``Precision.describe`` (a run's first line) says which kind of CPU a bf16 run is on.

A probe times one ``[32, 1024] @ [1024, 1024]`` matmul each way (under a second even where bf16
is emulated; the bf16 probe on one thread, robust to a busy neighbour) and keeps the ratio in
``$COOKBOOK_CACHE_DIR/cpu_probe.json``, keyed by the probe, the CPU's model name, torch's version
and the thread count; the file keeps the newest ``MAX_ENTRIES``.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from cookbook_lib.runtime.models import cache_dir

PROBE_FILE = "cpu_probe.json"
MAX_ENTRIES = 16
_SHAPE = (32, 1024, 1024)  # rows, inner, columns: a decode step's matmul, small enough to emulate


def cpu_model_name() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def fastest_seconds(matmul: Callable[[], object], min_total_s: float = 0.02, max_reps: int = 50) -> float:
    """The fastest of a few calls of ``matmul``, in seconds (at least ``min_total_s`` spent)."""
    matmul()  # first call: kernel selection and allocation, not the rate
    best, spent, reps = float("inf"), 0.0, 0
    while reps < max_reps and (spent < min_total_s or reps < 2):
        started = time.perf_counter()
        matmul()
        elapsed = time.perf_counter() - started
        best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
    return best


def linear_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and a ``[out, in]`` weight, as ``F.linear`` takes them."""
    rows, inner, columns = _SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=generator).to(dtype)
    weight = torch.randn(columns, inner, generator=generator).to(dtype)
    return x, weight


def seconds_per_linear(dtype: torch.dtype) -> float:
    """The probe's ``F.linear`` in ``dtype``, fastest of a few calls."""
    x, weight = linear_operands(dtype)
    return fastest_seconds(lambda: F.linear(x, weight))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the calling thread, then its count as before.

    A ratio of two rates is the same per core, and one thread cannot wait at a barrier for a
    partner whose core another process holds: on two cores beside a busy process, the two-thread
    probe read 1.07x and 87.7x where the machine does 4.2x, one thread 3.8-4.2x.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_bf16_speedup() -> float:
    """bf16 matmul rate over fp32's on one core of this CPU now (>1: bf16 is faster), uncached."""
    with torch.inference_mode(), one_thread():
        return seconds_per_linear(torch.float32) / seconds_per_linear(torch.bfloat16)


def bf16_speedup(cache: Path | None = None) -> float:
    """:func:`measure_bf16_speedup`, measured once per CPU model and torch version."""
    # "1 thread" in the name: entries of the earlier probe, on every core, are not read back.
    return cached_ratio("bf16 (1 thread)", measure_bf16_speedup, cache)


def cached_ratio(probe: str, measure: Callable[[], float], cache: Path | None = None) -> float:
    """``measure()``, run once per probe name, CPU model, torch version and thread count, then read
    from ``cache`` (default ``$COOKBOOK_CACHE_DIR``)."""
    path = (cache or cache_dir()) / PROBE_FILE
    key = f"{probe}: {cpu_model_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    if isinstance(entries.get(key), int | float):
        return float(entries[key])
    # Three significant figures, returned as stored: a cached run and the measuring one see one
    # number (a ratio of 0.02 rounded to 4 decimals lost 0.2% between the two).
    speedup = float(f"{measure():.3g}")
    entries.pop(key, None)
    entries[key] = speedup
    kept = dict(list(entries.items())[-MAX_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache costs a probe per run, nothing else
    return speedup
