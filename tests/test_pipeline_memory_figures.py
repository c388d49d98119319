"""What a stage peer says about its memory is its own: its peak is its own address space's
(not the peak of the bigger process that spawned it), and copies of its stage it freed leave
the process instead of staying resident in malloc's heaps (node/pipeline/memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _net_helpers import REPO

from murmur.node.pipeline.memory import MIB

pytestmark = pytest.mark.integration

CHILD_PEAK = "from murmur.node.pipeline.memory import peak_rss_mb; print(peak_rss_mb())"

# Weight-sized blocks freed while small ones allocated between them stay (as a peer frees a
# checkpoint's copies, a replaced replica or published state, around buffers it keeps).
FRAGMENTS = """
import ctypes, json, sys
from murmur.node.pipeline.memory import return_freed_memory, rss_mb
if sys.argv[1] == "fixed" and not return_freed_memory():
    print(json.dumps({"glibc": False})); raise SystemExit
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))  # one weight-sized copy freed (glibc raises its threshold past it)
big, small = [], []
start = rss_mb()
for _ in range(64):  # a transient of many weight-sized copies, small buffers kept between them
    p = libc.malloc(4 << 20); ctypes.memset(p, 1, 4 << 20); big.append(p)
    q = libc.malloc(64 << 10); ctypes.memset(q, 1, 64 << 10); small.append(q)
held = rss_mb()
for p in big:
    libc.free(p)
print(json.dumps({"glibc": True, "grew_mb": held - start, "after_mb": rss_mb() - start}))
"""


def test_a_child_reports_its_own_peak_not_its_parents():
    # This process touches 512 MiB; a child it spawns must not report that as its own peak
    # (ru_maxrss does: Linux carries it across exec).
    ballast = bytearray(512 * MIB)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    out = subprocess.run([sys.executable, "-c", CHILD_PEAK], capture_output=True, text=True, cwd=REPO,
                         start_new_session=True, timeout=120, check=True).stdout
    del ballast
    assert 1 < float(out) < 400, out  # the interpreter and what memory.py imports, not 512 MiB


def fragments(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, cwd=REPO,
                         timeout=120, check=True).stdout
    return json.loads(out)


def test_freed_copies_of_a_stage_leave_the_process():
    fixed = fragments("fixed")
    if not fixed["glibc"]:
        pytest.skip("not glibc: its own allocator decides")
    default = fragments("default")
    # glibc's default: the 4 MiB blocks freed in the middle of the heap stay resident
    assert default["grew_mb"] > 250 and default["after_mb"] > 200, default
    # with the stage peer's setting they are unmapped; the 64 small blocks kept (4 MiB) remain
    assert fixed["grew_mb"] > 250 and fixed["after_mb"] < 30, fixed
