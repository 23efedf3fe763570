"""Bounds on oneDNN's caches of compiled kernels: without them a run's memory creeps by half a gigabyte.

On a CPU, torch runs bf16 matmuls (autocast's, and a sampling copy's packed linears,
``runtime.packed_linear``) through oneDNN, which builds a kernel (a "primitive") for every
shape it meets and keeps it for the next call with that shape: up to 1,024 in oneDNN's own cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and up to 1,024 more in ideep's, torch's layer above it
(``LRU_CACHE_CAPACITY``). A GRPO run meets new shapes all the time: every prefill and every
training micro-batch has its own token count. Measured on a 2-core Xeon (2026-12-05): the embedded
model's five weight shapes at 300 row counts left 0.48 GB allocated (0.2-0.6 MB an entry, much of
it scratch memory), and over the demo's ten steps the process's allocated memory grew from 0.63
to 1.13 GB, the whole of the run's creep between phases. Bounded, the demo peaked at 3.48 GB
against 3.83, and a training step took the same time (docs/benchmarks.md, session 24).

A decode step needs a handful of these kernels at a time (each weight shape at the batch's row
count), a training micro-batch a few dozen (forward, the two backward matmuls, per shape), so
:data:`CAPACITY` entries in each cache keep what repeats and drop the shapes of past prefills.
Both variables are read once, when torch first uses oneDNN, so :func:`bound_onednn_caches` sets
them as the package is imported (``cookbook_lib/__init__.py``): a process that ran a bf16 matmul
before importing cookbook_lib keeps the defaults. A value the user set is left as it is.
"""

from __future__ import annotations

import os

CAPACITY = 64
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = CAPACITY) -> None:
    """Set both caches' capacity for this process and its children, where the user has not."""
    for variable in VARIABLES:
        os.environ.setdefault(variable, str(capacity))
