"""What the testnet benchmarks share (benchmarks/restart.py, benchmarks/chaos.py): the JSON's head
(device, date, load before and after, command, commit), and the results file that keeps every
earlier run (``rows_run_*``) beside the new one, so a rerun adds to the record instead of replacing it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "testnet-tiny.toml"


def out_option(parser: argparse.ArgumentParser, default: Path) -> None:
    """``--out``: the results file (its earlier runs are kept, see ``history``)."""
    parser.add_argument("--out", type=Path, default=default,
                        help=f"the results file (default {default.relative_to(REPO)}; earlier runs in it are kept)")


def load() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages (it is shared: every row states them)."""
    return [round(x, 1) for x in os.getloadavg()]


def commit() -> str:
    """HEAD, marked when the code the benchmark runs (node, coordinator, protocol) is changed."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "node", "coordinator", "protocol"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def head(benchmark: str, script: str, started: float, load_before: list[float]) -> dict:
    """The JSON's head for a run of ``script`` that began at ``started`` (time.time())."""
    return {
        "benchmark": benchmark,
        "device": f"cpu ({platform.processor() or platform.machine()}), shared by other jobs",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "commit": commit(),
        "load": {"before": load_before, "after": load()},  # 1, 5, 15 min
        "wall_s": round(time.time() - started),
        "config": str(CONFIG.relative_to(REPO)),
    }


def history(path: Path) -> dict:
    """The earlier runs a results file holds (``rows_run_*``), and its main rows as one more."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    kept = {k: v for k, v in old.items() if k.startswith("rows_run_")}
    if old.get("rows"):
        name = f"rows_run_{str(old.get('date', ''))[:10].replace('-', '_')}_{str(old.get('commit', ''))[:7]}"
        kept[name] = {k: old[k] for k in ("command", "commit", "date", "load", "note", "rows") if k in old}
    return kept


def write(path: Path, out: dict) -> None:
    """``out`` and the file's earlier runs, to ``path``."""
    out.update(history(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
