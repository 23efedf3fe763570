"""Trained weights in memory of their own, not in the pages of the file they were loaded from.

transformers loads a safetensors checkpoint on a CPU by mapping the file (``MAP_PRIVATE``) and
handing out tensors that point into the mapping: loading costs no copy, and the pages are the
page cache's until something writes to them. The first optimizer step writes every weight, and
each 4 KB page then faults as copy-on-write: the kernel copies the page and, before it may point
the process at the copy, flushes the old translation from every CPU running one of the process's
threads, with an inter-processor interrupt (an exit to the hypervisor in a VM). In the demo's
SFT warm-start on a 2-core VM that was ~4% of the run's kernel time, in the first AdamW step
(`perf`, docs/benchmarks.md, session 35). Copying the trainable weights out before training
faults fresh anonymous pages instead, which needs no flush.

Linux only (it reads ``/proc/self/maps``); elsewhere nothing is copied.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch

_MAPS = Path("/proc/self/maps")


def _file_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of this process's mappings of files (not anonymous memory, stacks, [vdso]),
    sorted by start; empty where ``/proc/self/maps`` cannot be read."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        # address perms offset dev inode [path]; an anonymous mapping has inode 0.
        if len(fields) == 6 and fields[4] != "0" and not fields[5].startswith("["):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return sorted(ranges)


def in_a_mapped_file(tensor: torch.Tensor, mappings: list[tuple[int, int]] | None = None) -> bool:
    """Whether ``tensor``'s data lies in a mapping of a file (``mappings``: :func:`_file_mappings`'s,
    read afresh when not given)."""
    mappings = _file_mappings() if mappings is None else mappings
    address = tensor.data_ptr()
    index = bisect.bisect_right(mappings, (address, float("inf"))) - 1
    return index >= 0 and address < mappings[index][1]


def copy_file_mapped_parameters(module: torch.nn.Module) -> int:
    """Give each trainable CPU parameter of ``module`` that points into a mapped file a copy of its
    own (the Parameter object stays, so tied weights stay tied); returns the bytes copied."""
    parameters = [p for p in module.parameters() if p.requires_grad and p.device.type == "cpu"]
    if not parameters:
        return 0
    mappings = _file_mappings()
    copied = 0
    with torch.no_grad():
        for parameter in parameters:
            if in_a_mapped_file(parameter, mappings):
                parameter.data = parameter.data.clone()
                copied += parameter.numel() * parameter.element_size()
    return copied
