"""torch's huge pages: an opt-in through THP_MEM_ALLOC_ENABLE, and what a training step does with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cookbook_lib.runtime import huge_pages, memory

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Four 64 MB tensors, written, then the process's anonymous huge pages in kB.
_HUGE_PAGES_PROBE = """
import torch
import cookbook_lib
tensors = [torch.ones(16 * 1024 * 1024) for _ in range(4)]
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(next(line for line in rollup if line.startswith("AnonHugePages")).split()[1])
"""


def huge_kb(variable: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != huge_pages.VARIABLE}
    if variable is not None:
        env[huge_pages.VARIABLE] = variable
    command = [sys.executable, "-c", _HUGE_PAGES_PROBE]
    return int(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(
    not THP_ENABLED.exists() or "[madvise]" not in THP_ENABLED.read_text(),
    reason="needs transparent huge pages in madvise mode (where only advised memory gets them)",
)
def test_torch_tensors_get_huge_pages_only_when_the_user_asks():
    assert huge_kb("1") >= 128 * 1024  # most of the 256 MB
    assert huge_kb(None) == 0  # importing cookbook_lib does not switch them on
    assert huge_kb("0") == 0


def test_a_step_keeps_blocks_under_32_mb_in_the_arenas_only_with_huge_pages(monkeypatch):
    monkeypatch.setenv(huge_pages.VARIABLE, "1")
    assert memory.step_mmap_threshold() == 32 * 1024 * 1024
    for off in ("0", "", "yes"):  # c10 reads only "1" as on
        monkeypatch.setenv(huge_pages.VARIABLE, off)
        assert memory.step_mmap_threshold() == 256 * 1024
    monkeypatch.delenv(huge_pages.VARIABLE)
    assert memory.step_mmap_threshold() == 256 * 1024
