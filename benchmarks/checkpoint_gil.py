"""What writing a checkpoint beside training costs the training thread: the GIL.

A node's round finisher writes its checkpoint in a thread while the training thread queues the
next window's kernels, one small torch call at a time; each call lets go of the GIL and has to get
it back. This measures the rate of such calls (two in-place ops on a 16-element tensor, in a loop)
alone and while another thread writes a checkpoint of --mb MiB over and over, fsynced:

  none             nobody else runs
  torch_save       torch.save, then fsync (murmur's checkpoint before node/daemon/checkpoint_file.py)
  checkpoint_file  node/daemon/checkpoint_file.py's save (tensor bytes through plain file writes)

    .venv/bin/python benchmarks/checkpoint_gil.py [--mb 512] [--seconds 4] [--repeats 3]

Writes benchmarks/results/checkpoint_gil.json: rows {writer, ops_per_s (median of the repeats),
ops_per_s_runs, relative (to none), writes}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from murmur.node.daemon import checkpoint_file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_gil.json"


def torch_save(state: dict, path: Path) -> None:
    torch.save(state, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


WRITERS = {"none": None, "torch_save": torch_save, "checkpoint_file": checkpoint_file.save}


def small_ops_rate(seconds: float) -> float:
    x = torch.zeros(16)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x.add_(1.0)
        x.mul_(0.5)
        n += 2
    return n / (time.perf_counter() - t0)


def measure(writer, state: dict, path: Path, seconds: float) -> tuple[float, int]:
    stop, writes = threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            writer(state, path)
            writes[0] += 1

    t = None
    if writer is not None:
        t = threading.Thread(target=loop)
        t.start()
        time.sleep(0.3)  # the writer is under way
    rate = small_ops_rate(seconds)
    stop.set()
    if t is not None:
        t.join()
    return rate, writes[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="checkpoint size in MiB (fp32 tensors of 64 MiB)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = max(1, args.mb // 64)
    state = {"model": {f"t{i}": torch.randn(16 * 1024 * 1024) for i in range(n)}, "round": 1}
    runs: dict[str, list[float]] = {k: [] for k in WRITERS}
    writes: dict[str, int] = dict.fromkeys(WRITERS, 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        for _ in range(args.repeats):  # interleaved, so a drift of the machine hits every writer
            for name, writer in WRITERS.items():
                rate, w = measure(writer, state, path, args.seconds)
                runs[name].append(rate)
                writes[name] += w
                print(f"{name:16s} {rate:12,.0f} ops/s ({w} writes)", flush=True)
    base = statistics.median(runs["none"])
    rows = [
        {
            "writer": name,
            "ops_per_s": round(statistics.median(r)),
            "ops_per_s_runs": [round(x) for x in r],
            "relative": round(statistics.median(r) / base, 3),
            "writes": writes[name],
        }
        for name, r in runs.items()
    ]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {
        "benchmark": "checkpoint_gil",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": ".venv/bin/python " + shlex.join(["benchmarks/checkpoint_gil.py", *sys.argv[1:]]),
        "commit": commit or None,
        "checkpoint_mib": n * 64,
        "rows": rows,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
