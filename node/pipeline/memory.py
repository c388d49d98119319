"""A stage peer's resident memory, as it reports it (its ready and stopped lines, the benchmarks)."""

from __future__ import annotations

import ctypes
import gc
import os
import resource

MIB = 1 << 20
# glibc's mallopt parameter, and the size from which every allocation gets its own mapping (a
# stage's weight-sized tensors; a microbatch's activations stay on the heap, where they are reused).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 * MIB


def return_freed_memory() -> bool:
    """Have glibc's malloc give every allocation of ``MMAP_THRESHOLD_BYTES`` or more a mapping of its
    own, unmapped when freed; True where that was set (glibc), False elsewhere (nothing changes).

    Why: by default glibc raises that threshold to the size of the largest block freed so far (up
    to 32 MiB), so once a stage peer frees its first weight-sized copy (a published state replaced,
    a replica refreshed, a checkpoint written, gradients summed), every later copy of that size
    comes from the heaps of whichever thread made it (the compute thread, gRPC's, asyncio's) and
    stays resident there after it is freed. A peer's resident memory then kept growing by copies of
    its stage it no longer held: measured on an 8-stage run of a 168M-parameter model, peers
    peaked at 1.6-1.9 GB with the default and 1.3-1.45 GB with a fixed threshold
    (benchmarks/pipeline_train.py, its memory row)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator's behaviour stays
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB: VmHWM, the high-water mark of this
    process's own address space. Not ``ru_maxrss``: Linux carries that across exec from the
    address space the process replaced, so a peer spawned by a big parent (a benchmark holding a
    model, pytest) would report the parent's peak as its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no procfs: the best there is


def rss_mb() -> float:
    """The process's resident memory now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def freeze_startup_heap() -> None:
    """Move every object alive now (torch's, grpc's, the stage's modules: what lives as long as the
    process) out of the garbage collector's sight, once the process is ready to serve.

    Why: each call a stage peer or a driver serves allocates a few hundred small objects, so the
    collector runs every few microbatches, and each of its full collections walked the whole start-up
    heap (300K objects, about 90 ms on the 2-core build machine) while the compute thread waited for
    the GIL. Frozen objects are still freed when their last reference goes; only a cycle among them
    is never collected. The coordinator does the same (coordinator/server.py)."""
    gc.collect()
    gc.freeze()


def collect_cycles() -> int:
    """A full collection of what the collector still watches (the start-up heap is frozen, so that
    is only what was made since: milliseconds); the objects it freed.

    Why: a round or a transfer that fails leaves its tensors in reference cycles (the exception's
    traceback holds the frames that hold them, and those frames the futures and gRPC calls that
    hold the exception). Such a cycle lives on while the failed round's task is kept, so the young
    collections promote it to the oldest generation, which a process with a frozen start-up heap
    almost never collects on its own (a full collection waits for a quarter as many new survivors
    as the heap had at the freeze: 300K objects). Measured: each failed within-stage round of a
    stage of 80 MiB left 250-330 MiB of tensors in such garbage, and ten failed rounds held over
    2 GiB (benchmarks/peer_memory.py, two peers a stage). The stage peer collects after each sync
    round, and after a replica's refresh or a checkpoint that failed."""
    return gc.collect()


def thaw_startup_heap() -> None:
    """Give the frozen heap back to the collector once the process has stopped serving, so the
    interpreter's shutdown frees it: left frozen, triton's extension counts its objects as leaked and
    prints "nanobind: leaked N instances!" into every stage peer's log at exit."""
    gc.unfreeze()
