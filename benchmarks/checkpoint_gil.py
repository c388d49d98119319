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
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpoint_bench import ROOT, checkpoint_state, head, interleaved, median, write  # noqa: E402

from murmur.node.daemon import checkpoint_file  # noqa: E402

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
    state, mib = checkpoint_state(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        cases = {name: (lambda w=writer: measure(w, state, path, args.seconds)) for name, writer in WRITERS.items()}
        runs = interleaved(cases, args.repeats, show=lambda name, got: print(
            f"{name:16s} {got[0]:12,.0f} ops/s ({got[1]} writes)", flush=True))
    base = median([rate for rate, _ in runs["none"]])
    rows = [
        {
            "writer": name,
            "ops_per_s": round(median([rate for rate, _ in r])),
            "ops_per_s_runs": [round(rate) for rate, _ in r],
            "relative": round(median([rate for rate, _ in r]) / base, 3),
            "writes": sum(w for _, w in r),
        }
        for name, r in runs.items()
    ]
    write(args.results, {**head("checkpoint_gil", "benchmarks/checkpoint_gil.py"), "checkpoint_mib": mib, "rows": rows})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
