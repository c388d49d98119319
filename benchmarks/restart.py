"""Where a restart's seconds go: a node SIGKILLed and restarted, and the coordinator.

    python benchmarks/restart.py                     # warm (forked) and cold starts, 5 restarts each
    python benchmarks/restart.py --restarts 3 --modes cold

A 3-node testnet (configs/testnet-tiny.toml, one torch thread a node, the testnet's loopback
deadlines). Once every node trains, one node at a time is SIGKILLed and started again at once
from its state folder; each restart's timeline is read from its log (ISO timestamps) against the
moment the process was started:

    joined_s          the join (or rejoin) answered: imports, the node's own inputs, the Join RPC
    dataplane_s       peer server and DHT up
    restored_s        model built, local checkpoint read and the newest state taken ("from round")
    first_round_s     its first recorded round whose update reached the model (``contributed``)
    prepare_s         of those, the model's build and the checkpoint's read themselves, which run
                      while the DHT's process starts (the node's "started in" line)

and the coordinator's: SIGKILLed and started on the same ledger and addresses, ``serving_s`` is
the time until it prints its listening line (its ledger open, gRPC and DHT up), and
``first_commit_s`` until the first commit after it (the nodes' journal replayed).

``warm`` starts fork each process from a server that has imported the node's stack already
(node/testnet/warm.py: what the testnet, chaos runs and tests use); ``cold`` starts are plain
``python -m murmur.cli`` (MURMUR_WARM_START=0: what a volunteer's machine does). Rows give the
median and max of each phase. The machine is shared: state the load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _testnet_bench as bench  # noqa: E402
from _testnet_bench import CONFIG, REPO  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "restart.json"
NODES = 3
WAIT_S = 300.0  # a phase on a loaded machine

PHASES = {
    "joined_s": r"(joined|rejoining) run ",
    "dataplane_s": r"peer server on ",
    "restored_s": r"node \w+: .* from round \d+",
}


def _stamp(line: str) -> float:
    return dt.datetime.fromisoformat(line[:29]).timestamp()


def _timeline(log: str, started: float) -> dict[str, float | None]:
    """Seconds from ``started`` to each phase's first log line (this incarnation's log only)."""
    out: dict[str, float | None] = {}
    for phase, pattern in PHASES.items():
        line = next((ln for ln in log.splitlines() if ln[:4].isdigit() and re.search(pattern, ln)), None)
        out[phase] = round(_stamp(line) - started, 2) if line else None
    built = re.search(r"model and checkpoint ([\d.]+) s", log)
    out["prepare_s"] = float(built.group(1)) if built else None
    return out


def _first_round(node, started: float) -> float | None:
    from murmur.node.daemon.state_dir import read_rounds

    times = [float(r["time"]) for r in read_rounds(node.state_dir)
             if "loss" in r and r.get("contributed", True) and float(r["time"]) > started]
    return round(min(times) - started, 2) if times else None


def _rows(restarts: int, mode: str, data: Path) -> tuple[list[dict], list[dict]]:
    from murmur.node.daemon.state_dir import read_rounds
    from murmur.node.testnet.cli import LOOPBACK_COORDINATOR, LOOPBACK_NODE, load_run, write_run
    from murmur.node.testnet.procs import Testnet, wait_for

    os.environ["MURMUR_WARM_START"] = "1" if mode == "warm" else "0"
    nodes, coords = [], []
    with tempfile.TemporaryDirectory(prefix="murmur-restart-") as tmp:
        root = Path(tmp)
        config, data = write_run(load_run(str(CONFIG), ["train.steps=100000", f'data.path="{data}"']), root)
        net = Testnet(root=root, config_path=config, data=data, threads=1, node_args=list(LOOPBACK_NODE),
                      coordinator_args=list(LOOPBACK_COORDINATOR))
        with net:
            net.start_coordinator()
            net.create_run(token_uses=NODES * 4)
            for _ in range(NODES):
                net.add_node(extra=["--min-peers", str(NODES)])
            wait_for(lambda: all(any("loss" in r for r in read_rounds(n.state_dir)) for n in net.nodes),
                     WAIT_S, poll_s=1.0, what="every node's first round")
            for i in range(restarts):
                node = net.nodes[i % NODES]
                net.kill_node(node)
                offset = node.log_path.stat().st_size
                started = time.time()
                net.start_node(node)
                wait_for(lambda n=node, s=started: _first_round(n, s) is not None, WAIT_S, poll_s=0.2,
                         what=f"{node.name}'s first round after its restart")
                log = node.log_path.read_bytes()[offset:].decode(errors="replace")
                row = {"node": node.name, **_timeline(log, started), "first_round_s": _first_round(node, started)}
                nodes.append(row)
                print(json.dumps({"mode": mode, **row}), flush=True)
            for _ in range(max(1, restarts // 2)):
                address = str(net.info["address"])
                net.kill_coordinator()
                net.stop_coordinator()
                started = time.time()
                net.start_coordinator(address)
                serving = time.time() - started
                seen = int(net.admin("status", "--run", net.run_id)["run"]["tokens_committed"])
                wait_for(lambda s=seen: int(net.admin("status", "--run", net.run_id)["run"]["tokens_committed"]) > s,
                         WAIT_S, poll_s=0.2, what="a commit after the coordinator restart")
                row = {"serving_s": round(serving, 2), "first_commit_s": round(time.time() - started, 2)}
                coords.append(row)
                print(json.dumps({"mode": mode, "coordinator": row}), flush=True)
    return nodes, coords


def _summary(rows: list[dict], keys: list[str]) -> dict:
    out = {}
    for k in keys:
        xs = [r[k] for r in rows if r.get(k) is not None]
        out[k] = {"median": round(statistics.median(xs), 2), "max": max(xs)} if xs else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--restarts", type=int, default=5, help="node restarts per mode (coordinator: half)")
    p.add_argument("--modes", default="warm,cold", help="warm, cold or both")
    bench.out_option(p, RESULTS)
    args = p.parse_args()
    from murmur.node.model.data import prepare

    started = time.time()
    load_before = bench.load()
    rows = []
    with tempfile.TemporaryDirectory(prefix="murmur-restart-data-") as tmp:
        data = Path(tmp) / "data"
        prepare(data, tokenizer="byte", shard_tokens=8192)
        for mode in args.modes.split(","):
            nodes, coords = _rows(args.restarts, mode, data)
            rows.append({
                "mode": mode,
                "node": _summary(nodes, ["joined_s", "dataplane_s", "prepare_s", "restored_s", "first_round_s"]),
                "coordinator": _summary(coords, ["serving_s", "first_commit_s"]),
                "node_restarts": nodes,
                "coordinator_restarts": coords,
            })
    bench.write(args.out, {**bench.head("restart", "benchmarks/restart.py", started, load_before), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
