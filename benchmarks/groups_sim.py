"""Bounded groups at 1,000 peers, simulated: rounds completed, peers holding the result, bytes and
connections a peer, with 0, 1 and 3 kills a round (and 64, 32 and 8 peers) (node/exchange/simulate.py: the real group
formation and failure rules over a simulated transport; the codec's own bytes).

    nice .venv/bin/python benchmarks/groups_sim.py [--numel 1048576] [--rounds 20]

Writes benchmarks/results/groups_sim.json with the device, date, load, command, commit and rows
(the row keys of the scale benchmark, plus the butterfly's figures beside them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from murmur.node.exchange.simulate import simulate_rounds

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "groups_sim.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for peers, kills in ((1000, 0), (1000, 1), (1000, 3), (64, 0), (64, 1), (32, 1), (8, 0)):
        row = simulate_rounds(peers, args.group_size, args.numel, args.codec, kills, args.rounds, args.seed)
        print(json.dumps(row), flush=True)
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {
        "benchmark": "groups_sim",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (simulated transport)",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": round(load, 2),
        "command": "nice .venv/bin/python " + shlex.join(["benchmarks/groups_sim.py", *sys.argv[1:]]),
        "commit": commit or None,
        "rows": rows,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
