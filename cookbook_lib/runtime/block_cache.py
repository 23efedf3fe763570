"""A bounded cache of freed large CPU blocks for torch: a step reuses its pages instead of faulting them in.

torch allocates CPU tensors with ``malloc``. A training step frees and allocates gigabytes of
activations; kept in glibc's arenas their holes fragmented the heap by ~1 GB, so a step maps
every block of 256 KB or more on its own (``memory.large_blocks_mapped``), and each of its 4 KB
pages faults again when next touched: a demo step spent a third of its user time in the kernel
(docs/benchmarks.md, session 21). ``block_cache.cpp`` replaces torch's CPU allocator (through
c10's ``SetCPUAllocator``): a freed block of 256 KB or more stays mapped, up to a bound on the
bytes waiting (``COOKBOOK_BLOCK_CACHE_MB``, default :data:`DEFAULT_LIMIT_MB`), and the next
allocation that fits in it gets it back with its pages already there (cut to size where it is
more than an eighth larger, where there is no room for a new block). Before a miss maps a new
block it unmaps cached blocks until live and cached blocks are within :data:`SLACK_BYTES` of the
live peak since the cache was last emptied, so the cache raises the process's peak by that much at
most. Smaller
blocks go to torch's allocator as before. :func:`release_block_cache` unmaps what waits;
``memory.release_memory`` calls it between the phases of a run. Requests are rounded up to one of
eight sizes per power of two (at most 1/8 more), so that nearly equal sizes (a prefill of 512 or
530 tokens) share blocks. Measured on a demo step (``bench/bench_page_faults.py``,
docs/benchmarks.md): the trainer's time 0.83x, system time 0.49x, page faults 0.45x, the same peak
and the same loss.

It serves only while active (:func:`block_cache_active`): the trainer enters it for each training
step (``memory.large_blocks_mapped``), the generator for each prefill and decode step; elsewhere
every block goes to torch's allocator as before. Sampling from glibc's heap faulted less, but the
heap's holes kept the demo's resident peak ~0.4 GB higher (4.41 against 4.03 GB, 2026-12-05).

torch exposes no CPU caching allocator to Python, so the cache is C++, compiled on first use with
the machine's C++ compiler against the installed torch's headers (a few seconds) and kept in
``$COOKBOOK_CACHE_DIR/block_cache/``, keyed by the source, torch's version and the compiler.
Where there is no compiler, the build fails, or the platform is not Linux, runs go on as before
(the reason is logged once). ``COOKBOOK_BLOCK_CACHE=0`` switches it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cookbook_lib.runtime.huge_pages import huge_pages_requested
from cookbook_lib.runtime.models import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("block_cache.cpp")
SWITCH = "COOKBOOK_BLOCK_CACHE"
LIMIT_VARIABLE = "COOKBOOK_BLOCK_CACHE_MB"
DEFAULT_LIMIT_MB = 512
# Blocks from this size on are cached; the same size from which a step maps blocks on its own.
THRESHOLD_BYTES = 256 * 1024
# How far live and cached blocks together may pass the peak live blocks alone reached since the
# cache was last emptied: a decode step's sampling allocates 3 MB and 6 MB blocks, which do not
# serve each other, and with no slack two of them missed (9 MB faulted) every step. A prefill
# frees blocks of ~20 sizes layer after layer (its 16 x 419-token forward: ~1,000 blocks, 1.3 to
# 41 MB): at 32 MB of slack a miss evicted the largest cached blocks, which the next layer needed,
# and a repeated prefill still faulted 597k pages (2.3 GB); at 256 MB, 95 pages.
# The demo: system time 11.5% -> 8.8% of user, peak 3.18 -> 3.29 GB (docs/benchmarks.md, session 25).
SLACK_BYTES = 256 * 1024 * 1024
_BUILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class BlockCacheStats:
    """What the cache holds now and has done since it was installed."""

    cached_bytes: int  # freed blocks waiting, mapped and resident
    live_bytes: int  # blocks of the cache's size that tensors use now
    hits: int  # allocations served from the cache
    misses: int  # allocations that mapped a new block
    limit_bytes: int
    threshold_bytes: int


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _torch_paths() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def _build(compiler: str, target: Path) -> None:
    """Compiles ``block_cache.cpp`` into ``target`` (atomically: concurrent builds cannot see half a file)."""
    include, lib = _torch_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [
            compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(include), str(SOURCE), "-L", str(lib), "-lc10", f"-Wl,-rpath,{lib}", "-o", str(built),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:2])} ... failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(compiler.encode())
    return cache_dir() / "block_cache" / f"block_cache-{key.hexdigest()[:16]}.so"


def limit_bytes() -> int:
    """The bound on freed bytes the cache keeps, from ``COOKBOOK_BLOCK_CACHE_MB`` (default 512)."""
    raw = os.environ.get(LIMIT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_LIMIT_MB * 1024 * 1024
    try:
        megabytes = int(raw)
    except ValueError:
        raise ValueError(f"{LIMIT_VARIABLE}={raw!r} is not a whole number of megabytes; e.g. 512") from None
    if megabytes < 0:
        raise ValueError(f"{LIMIT_VARIABLE}={raw!r} must be 0 or more megabytes")
    return megabytes * 1024 * 1024


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built and loaded cache, or None (and why, logged once) where it cannot be had."""
    if os.environ.get(SWITCH, "").strip() == "0":
        return None
    if not sys.platform.startswith("linux"):
        logger.info("CPU block cache off: built for Linux only (this is %s)", sys.platform)
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("CPU block cache off: no C++ compiler (c++, g++, clang++ or $CXX) on PATH")
        return None
    path = _library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.info("CPU block cache off: %s", error)
        return None
    library.cookbook_block_cache_install.argtypes = [ctypes.c_uint64] * 3 + [ctypes.c_int]
    library.cookbook_block_cache_install.restype = ctypes.c_int
    library.cookbook_block_cache_release.restype = ctypes.c_uint64
    library.cookbook_block_cache_set_limit.argtypes = [ctypes.c_uint64]
    library.cookbook_block_cache_set_active.argtypes = [ctypes.c_int]
    library.cookbook_block_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    return library


@functools.cache
def install_block_cache() -> bool:
    """Makes the cache torch's CPU allocator for the rest of the process; whether it is.

    Idempotent. False where it is switched off, cannot be built here, or another allocator of
    higher priority is in place (then torch's allocation is unchanged).
    """
    library = _library()
    if library is None:
        return False
    limit = limit_bytes()
    huge_pages = int(huge_pages_requested())
    installed = bool(library.cookbook_block_cache_install(THRESHOLD_BYTES, limit, SLACK_BYTES, huge_pages))
    if not installed:
        logger.info("CPU block cache off: another CPU allocator of higher priority is in place")
    return installed


def block_cache_installed() -> bool:
    """Whether the cache is torch's CPU allocator (without installing it)."""
    return install_block_cache.cache_info().currsize > 0 and install_block_cache()


_active_lock = threading.Lock()
_depths = {"active": 0, "suspended": 0}  # how many of each context are open, over all threads


@contextlib.contextmanager
def _counted(kind: str) -> Iterator[None]:
    """Counts one open ``kind`` context; the cache serves while some are active and none suspended."""
    library = _library() if block_cache_installed() else None
    if library is None:
        yield
        return

    def change(by: int) -> None:
        with _active_lock:
            _depths[kind] += by
            library.cookbook_block_cache_set_active(int(_depths["active"] > 0 and _depths["suspended"] == 0))

    change(+1)
    try:
        yield
    finally:
        change(-1)


def block_cache_active() -> contextlib.AbstractContextManager:
    """Within the block, large CPU tensors come from the cache (where it is installed).

    Blocks may nest and overlap on several threads: the cache serves until the last one ends.
    Blocks freed after that are unmapped at once, not cached; what waits stays until
    :func:`release_block_cache`.
    """
    return _counted("active")


def block_cache_suspended() -> contextlib.AbstractContextManager:
    """Within the block the cache serves nothing, training steps included: allocation as before it
    (a bench's baseline arm, in the same process as the arms that use it)."""
    return _counted("suspended")


def release_block_cache() -> int:
    """Unmaps every freed block waiting in the cache; the bytes handed back (0 when not installed)."""
    if not block_cache_installed():
        return 0
    library = _library()
    assert library is not None
    return int(library.cookbook_block_cache_release())


def set_block_cache_limit(limit: int) -> None:
    """Changes the bound on waiting bytes; what waits beyond it is unmapped now."""
    if limit < 0:
        raise ValueError(f"a block cache limit is 0 or more bytes, not {limit}")
    if block_cache_installed():
        library = _library()
        assert library is not None
        library.cookbook_block_cache_set_limit(limit)


def block_cache_stats() -> BlockCacheStats | None:
    """The cache's figures, or None when it is not installed."""
    if not block_cache_installed():
        return None
    library = _library()
    assert library is not None
    out = (ctypes.c_uint64 * 6)()
    library.cookbook_block_cache_stats(out)
    return BlockCacheStats(*(int(value) for value in out))
