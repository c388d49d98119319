"""What the checkpoint benchmarks share (benchmarks/checksum.py, benchmarks/checkpoint_gil.py): the
checkpoint they write, the loop that runs every case once per repeat, interleaved, so that a drift
of the shared machine hits every case alike, and the JSON's head and file.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TENSOR_MIB = 64  # the checkpoint is made of fp32 tensors of this size


def checkpoint_state(mb: int) -> tuple[dict, int]:
    """A node checkpoint's shape of about ``mb`` MiB ({"model": tensors, "round"}), and its MiB."""
    n = max(1, mb // TENSOR_MIB)
    numel = TENSOR_MIB * 1024 * 1024 // 4
    return {"model": {f"t{i}": torch.randn(numel) for i in range(n)}, "round": 1}, n * TENSOR_MIB


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(cases: dict[str, Callable[[], object]], repeats: int,
                show: Callable[[str, object], None] | None = None) -> dict[str, list]:
    """Each case's measurements: every case once per repeat, in order (not one case's repeats in a
    row), so that a change of the machine's load meanwhile lands on every case."""
    runs: dict[str, list] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            runs[name].append(case())
            if show is not None:
                show(name, runs[name][-1])
    return runs


def median(values: list[float]) -> float:
    return statistics.median(values)


def head(benchmark: str, script: str, prefix: str = ".venv/bin/python") -> dict:
    """The JSON's head: the benchmark, the device, the date, the load, the command and the commit."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {
        "benchmark": benchmark,
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": round(os.getloadavg()[0], 2),
        "command": f"{prefix} " + shlex.join([script, *sys.argv[1:]]),
        "commit": commit or None,
    }


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
