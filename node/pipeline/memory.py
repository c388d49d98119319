"""A stage peer's resident memory, as it reports it (its ready and stopped lines, the benchmarks)."""

from __future__ import annotations

import os
import resource

MIB = 1 << 20


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """The process's resident memory now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
