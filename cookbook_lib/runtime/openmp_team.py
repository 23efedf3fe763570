"""Letting go of a thread's idle OpenMP team, so the thread that computes keeps its cores spinning.

On a CPU each thread that has run a parallel torch op keeps an OpenMP team (its pool of helper
threads) for as long as it lives. Once libgomp manages more threads than there are CPUs it stops
spin-waiting between parallel regions, so every op of the thread that does compute pays a
wake-up. A generator decodes on its worker thread; if the caller's thread once ran a parallel op
(building a bf16 sampling copy does: its casts), its idle team stays and the worker's decode step
took 88 ms instead of 52 (16 rows of the embedded model in bf16, a 2-core Xeon, 2026-12-05).

:func:`release_openmp_team` frees the calling thread's team through OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)``, which libgomp implements as exactly that (its helper
threads exit; a later parallel op on this thread builds a new team). ``HFGenerator.sample`` calls
it before handing a request to the worker, so the caller's thread, which then only waits, holds no
team. Where the OpenMP runtime lacks the call, or outside Linux, it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft keeps what a later region reuses, hard frees all
# The OpenMP runtimes a torch build links: GNU's (Linux wheels), LLVM's, Intel's.
_RUNTIME_NAMES = ("libgomp", "libomp", "libiomp5")


def _loaded_runtime() -> Path | None:
    """The OpenMP runtime torch computes with, among those this process has mapped (/proc/self/maps).

    Other packages may map a runtime of their own (the system's libgomp): pausing that one would
    free nothing of torch's teams. So torch's own copy (a pip wheel ships it in ``torch/lib``) comes
    first, then one beside torch's libraries (a conda environment's ``lib``), then any.
    """
    import torch

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    mapped = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = Path(fields[5]) if len(fields) == 6 else None
        if path is not None and any(path.name.startswith(name) for name in _RUNTIME_NAMES):
            mapped.append(path)
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    environment_lib = Path(sys.prefix) / "lib"
    for preferred in (torch_lib, environment_lib):
        for path in mapped:
            if path.resolve().parent == preferred.resolve():
                return path
    return mapped[0] if mapped else None


@functools.cache
def _pause_function() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    runtime = _loaded_runtime()
    if runtime is None:
        return None
    try:
        function = ctypes.CDLL(str(runtime)).omp_pause_resource_all  # the mapped copy, not another
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return function


def release_openmp_team() -> bool:
    """Free the calling thread's idle OpenMP team; whether it was freed (not inside a parallel region)."""
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
