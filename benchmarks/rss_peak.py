"""A child process's peak resident memory, read from /proc from outside: the memory benchmarks'
one sampler (benchmarks/pipeline_train.py, benchmarks/peer_memory.py).

VmHWM, the high-water mark of the process's own address space, only grows, so polling it keeps
the peak up to one period before the process exits; a process that reports its own peak at a
clean stop (a stage peer's "stopped" line) gives the exact figure, this one the same for processes
that do not (``murmur train``) or die."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path


def vm_hwm_mb(pid: int) -> float | None:
    """A process's peak resident memory so far (VmHWM) in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def watch_peak(proc: subprocess.Popen, into: list[float], every_s: float = 0.1) -> threading.Thread:
    """Poll ``proc``'s VmHWM in a thread until it exits, keeping the largest in ``into[0]``."""
    def poll() -> None:
        while proc.poll() is None:
            mb = vm_hwm_mb(proc.pid)
            if mb is not None:
                into[0] = max(into[0], mb)
            time.sleep(every_s)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return t
