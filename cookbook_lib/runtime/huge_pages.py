"""Whether torch's huge pages for large CPU tensors are on: an opt-in, faster at a higher peak.

With ``THP_MEM_ALLOC_ENABLE=1`` in the environment before torch loads (torch reads it once, at
its first allocation), CPU tensors of 2 MB or more are advised ``MADV_HUGEPAGE``, so where the
kernel's transparent huge pages are ``madvise`` or ``always``
(``/sys/kernel/mm/transparent_hugepage/enabled``) they fault in 2 MB at a time instead of 4 KB.
A training step allocates and frees gigabytes, and with it on ``memory.large_blocks_mapped``
keeps a step's blocks under 32 MB in glibc's arenas. Measured on the demo (2-core AMD EPYC,
``bench/bench_page_faults.py`` and docs/benchmarks.md, session 14): a step 0.70-0.74x the time,
the demo 8:48 wall with 6.6% of user time in the kernel (12-15% without), and a 5.0 GB resident
peak (3.7-4.1 GB without): over the 4 GB budget of a laptop run, so it is not the default.
Side by side with the defaults (session 16): 0.96x the wall time, system time 7.9% of user against
13.5%, no faster training per token, a 4.56 GB peak against 4.30.
``THP_MEM_ALLOC_ENABLE=1 python -m recipes.demo`` turns it on where memory is plentiful.
"""

from __future__ import annotations

import os

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def huge_pages_requested() -> bool:
    """Whether torch's huge-page switch is on in this environment (c10 reads "1" as on, "0" as off)."""
    return os.environ.get(VARIABLE, "").strip() == "1"
