"""Handing memory that a run has freed back to the operating system, between the phases of a run.

glibc's ``malloc`` keeps what a program frees for its next allocations rather than returning it to
the system, in one arena per thread that allocates (up to eight per core). A GRPO run allocates
from three kinds of threads: the event loop, each generator's worker (KV caches) and the trainer's
thread (activations, gradients). A training step frees gigabytes of activations, a finished batch
its KV cache; much of it would stay resident in the arena of the thread that freed it, where the
other threads cannot use it, and the process's resident size would be the sum of every thread's
own peak rather than the peak of what is live. :func:`release_memory` returns the free pages of
every arena (``malloc_trim``) after each step, validation and checkpoint.

Within a training step, trimming is too late: glibc serves blocks of up to 32 MB (after its
first few frees) from the arenas, and the backward pass's mix of freed activations and new
gradients leaves holes that the next allocations do not fit, so a step's resident peak was ~4x
its live memory (measured with the embedded model and activation checkpointing: 1.1 GB more than
the weights and AdamW state, against 0.2 GB live). :func:`large_blocks_mapped` gives every block
of 256 KB or more its own mapping for the duration of a step, returned to the system the moment
it is freed; that removed those 0.9 GB. Such blocks come back from the kernel unbacked, and a
demo step spent 35% of its user time in the kernel faulting 4 KB pages: where the user switches
torch's huge pages on, a step keeps blocks under 32 MB in the arenas instead
(:func:`step_mmap_threshold`; the measurements and why it is an opt-in: ``runtime.huge_pages``).

Elsewhere (macOS, musl) there is no ``malloc_trim`` or ``mallopt``: :func:`release_memory` only
collects Python's garbage and :func:`large_blocks_mapped` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import threading
from collections.abc import Iterator

from cookbook_lib.runtime.block_cache import block_cache_active, release_block_cache
from cookbook_lib.runtime.huge_pages import huge_pages_requested

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
_STEP_MMAP_THRESHOLD = 256 * 1024
_STEP_MMAP_THRESHOLD_HUGE_PAGES = 32 * 1024 * 1024
# glibc's own ceiling for its sliding threshold (64-bit): outside steps, blocks up to 32 MB (a
# generator's KV cache layers, copied at every decode step) are reused from the arenas, as before.
_DEFAULT_MMAP_THRESHOLD = 32 * 1024 * 1024
_steps_lock = threading.Lock()
_steps_running = 0


@functools.cache
def _libc_function(name: str, argtypes: tuple, restype):
    """A function of glibc's malloc, or None where the C library has none (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


def _malloc_trim():
    return _libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def _mallopt():
    return _libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)


def can_release_memory() -> bool:
    """Whether :func:`release_memory` can hand memory back to the system here (glibc)."""
    return _malloc_trim() is not None


def release_memory(full_collection: bool = True) -> None:
    """Collect garbage, then return the CPU block cache's waiting blocks (``runtime.block_cache``)
    and every arena's free pages (glibc only) to the system.

    ``full_collection=False`` collects only the young generations, where a training step's
    garbage is: a full collection walks every object the process holds, ~0.23 s once
    transformers is imported (367k objects), and a step released memory twice; 75% of a tiny
    model's SFT warm-start went there. Trimming costs milliseconds for gigabytes. Call it between
    phases, when the memory a phase used is free, not inside a hot loop.
    """
    gc.collect(2 if full_collection else 1)
    release_block_cache()  # the freed large blocks torch's CPU tensors would have reused
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def step_mmap_threshold() -> int:
    """The size from which a training step's blocks get their own mapping: 256 KB (the step's
    resident size follows its live memory, every 4 KB page faults), or 32 MB where the user switched
    torch's huge pages on (blocks under it are reused from the arenas, larger ones fault 2 MB at a
    time: faster, with a higher peak)."""
    return _STEP_MMAP_THRESHOLD_HUGE_PAGES if huge_pages_requested() else _STEP_MMAP_THRESHOLD


@contextlib.contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Within the block, allocations of 256 KB or more get their own mapping (glibc only); 32 MB
    or more where torch's huge pages are on (:func:`step_mmap_threshold`).

    Such a block goes back to the system the moment it is freed, so a training step's resident
    size follows its live memory. Steps on several threads may overlap: the threshold goes back
    when the last one ends.
    """
    global _steps_running
    mallopt = _mallopt()
    if mallopt is None:
        with block_cache_active():
            yield
        return
    with _steps_lock:
        _steps_running += 1
        if _steps_running == 1:
            mallopt(_M_MMAP_THRESHOLD, step_mmap_threshold())
    try:
        with block_cache_active():  # where the trainer installed it: the step's blocks reuse pages
            yield
    finally:
        with _steps_lock:
            _steps_running -= 1
            if _steps_running == 0:
                mallopt(_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD)
