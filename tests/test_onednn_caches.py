"""oneDNN's kernel caches are bounded from the package's import on: a run meeting new matmul shapes
does not keep a kernel, and its scratch memory, for every one (runtime/onednn_caches.py)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from cookbook_lib.runtime.onednn_caches import CAPACITY, VARIABLES
from cookbook_lib.runtime.packed_linear import packs

# A fresh process: the capacities are read once, at torch's first oneDNN call. It packs two bf16
# weights as a sampling copy does and runs them at 200 row counts (400 kernels), printing the
# bytes malloc holds afterwards over those before.
_SCRIPT = """
import ctypes, json
import cookbook_lib  # first: it bounds the caches before torch runs oneDNN
import torch
from cookbook_lib.runtime.packed_linear import pack_weight, packed_linear_forward

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def allocated():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

weights = [torch.randn(shape).bfloat16() for shape in ((576, 576), (1536, 576))]
packed = [pack_weight(w) for w in weights]
with torch.inference_mode():
    packed_linear_forward(torch.randn(1, 576).bfloat16(), packed[0], None)
    before = allocated()
    for rows in range(2, 202):
        for p in packed:
            packed_linear_forward(torch.randn(rows, 576).bfloat16(), p, None)
print(json.dumps({"grown": allocated() - before}))
"""


def _has_mallinfo2() -> bool:
    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018 (glibc 2.33 on)
    except (OSError, AttributeError):
        return False
    return True


def _grown_bytes(environment: dict[str, str]) -> int:
    command = [sys.executable, "-c", _SCRIPT]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["grown"]


def test_importing_the_package_sets_both_capacities_and_keeps_the_users(monkeypatch):
    from cookbook_lib.runtime.onednn_caches import bound_onednn_caches

    monkeypatch.delenv(VARIABLES[0], raising=False)
    monkeypatch.setenv(VARIABLES[1], "7")
    bound_onednn_caches()
    assert os.environ[VARIABLES[0]] == str(CAPACITY)
    assert os.environ[VARIABLES[1]] == "7"  # the user's own value wins


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc's mallinfo2 to read what malloc holds")
@pytest.mark.skipif(not packs(torch.bfloat16), reason="needs torch's oneDNN bf16 linears")
def test_new_matmul_shapes_do_not_pile_up_kernels():
    environment = {name: value for name, value in os.environ.items() if name not in VARIABLES}
    bounded = _grown_bytes(environment)
    unbounded = _grown_bytes({**environment, **{name: "1024" for name in VARIABLES}})
    # 400 kernels kept take ~0.1 GB of scratch and code; 64 a sixth of that.
    assert unbounded > 3 * bounded, (bounded, unbounded)
    assert bounded < 48 * 2**20, bounded
