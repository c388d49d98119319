"""Compute utilization of N nodes over an emulated slow link: how much of the wall time the nodes
spend computing rather than waiting for their exchange.

    python benchmarks/utilization.py [--nodes 4] [--link-mbps 100] [--latency-ms 50] [--quick]

Each node is the daemon's training side (`NodeTrainer`: the same windows, sync hooks and compute
timer as `murmur node run`), one thread each with one torch thread, in one process. They exchange
through the in-process group (which computes the real result and the real byte counts of every
codec) behind a link emulator: every node has one link of ``--link-mbps`` (full duplex, shared by
its transfers in order) and a one-way ``--latency-ms``; a round's result reaches a node only after
its bytes have crossed its link (reduce-scatter and all-gather: two latencies per round). Nothing is
slept in the training thread itself: a node that does not wait for its future (Streaming DiLoCo's
overlap) keeps computing, which is the point being measured.

compute_utilization = sum over nodes of compute seconds / sum of wall seconds, where compute is
forward + backward + optimizer and wall is the whole run of the node's windows.

Writes benchmarks/results/utilization.json with rows
{algo, codec, nodes, link_mbps, latency_ms, compute_utilization, bytes_per_node, ddp_bytes_per_node,
mode: "threads"}.

``--mode processes`` (root: network namespaces) measures the same thing with nothing modelled:
a real coordinator on the host and ``--nodes`` node daemons (`murmur node run`), each in its own
network namespace on one bridge with its upload shaped by ``tc tbf`` to ``--link-mbps`` (the
namespaces of benchmarks/exchange.py, reused: do not run both at once), exchanging over gRPC
through the hivemind DHT. A node's compute time is its own timer (rounds.jsonl's compute_seconds:
the steps less their exchange waits); its wall time runs from its first kept round record to its
last (the daemon's work between windows counted), the first ``--warmup-rounds`` left out:

    sudo .venv/bin/python benchmarks/utilization.py --mode processes --link-mbps 100,1000 --rounds 8

Those rows carry mode "processes" and sit beside the thread rows, which are kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from murmur.node.daemon.training import NodeTrainer
from murmur.node.daemon.window_types import LeaseView
from murmur.node.model.data import Dataset, prepare
from murmur.optim.exchange import Exchange
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.optim.inprocess import InProcessGroup
from murmur.protocol.model_shape import ddp_bytes
from murmur.protocol.runconfig import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "utilization.json"
JOIN_TIMEOUT_S = 3600.0  # one configuration's run; generous, the benchmark is never timed out by it


class Link:
    """One node's link: transfers queue behind each other at ``mbps``; each adds one-way latencies."""

    def __init__(self, mbps: float, latency_ms: float) -> None:
        self.bytes_per_s = mbps * 1e6 / 8
        self.latency_s = latency_ms / 1000
        self.free_at = 0.0
        self.lock = threading.Lock()

    def delivery_time(self, start: float, nbytes: int, hops: int) -> float:
        with self.lock:
            begin = max(start, self.free_at)
            self.free_at = begin + nbytes / self.bytes_per_s
            return self.free_at + hops * self.latency_s


class LinkExchange(Exchange):
    """Delays each result until this node's share of the round has crossed its emulated link."""

    def __init__(self, inner: Exchange, link: Link) -> None:
        self.inner, self.link = inner, link

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def _delayed(self, fut: Future, submitted: float) -> Future:
        out: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            result = f.result()
            # Sent and received overlap on a full-duplex link: the larger of the two is the cost.
            nbytes = max(result.bytes_sent, result.bytes_received)
            due = self.link.delivery_time(submitted, nbytes, hops=2)
            delay = max(0.0, due - time.monotonic())
            timer = threading.Timer(delay, out.set_result, args=(result,))
            timer.daemon = True
            timer.start()

        fut.add_done_callback(done)
        return out

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ):
        now = time.monotonic()
        return self._delayed(self.inner.all_reduce(tensors, round_id=round_id, key=key, weight=weight), now)

    def all_gather(self, wire, *, round_id: int, key: str = ""):  # noqa: ANN001
        now = time.monotonic()
        return self._delayed(self.inner.all_gather(wire, round_id=round_id, key=key), now)


def run_config(cfg, dataset: Dataset, nodes: int, mbps: float, latency_ms: float, windows: int) -> dict:
    peers = [f"n{i}" for i in range(nodes)]
    group = InProcessGroup(peers, lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))
    trainers = [
        NodeTrainer(
            cfg,
            dataset,
            torch.device("cpu"),
            LinkExchange(group.exchange(p), Link(mbps, latency_ms)),
            round_timeout_s=JOIN_TIMEOUT_S,
        )
        for p in peers
    ]
    stats: list[tuple[float, float]] = [(0.0, 0.0)] * nodes
    errors: list[BaseException] = []

    def leases(i: int):
        shards = list(range(i, dataset.num_shards, nodes))

        def next_lease(done):  # noqa: ANN001
            s = shards.pop(0)
            return LeaseView(f"{i}-{s}", s, 0, dataset.shard_size(s))

        return next_lease

    def work(i: int) -> None:
        torch.set_num_threads(1)
        t = trainers[i]
        source = leases(i)
        compute, t0 = 0.0, time.perf_counter()
        try:
            for _ in range(windows):
                compute += t.run_window(source, lambda: False).compute_seconds
            t.finish()  # in-flight fragments land: their wait is part of the wall time
        except BaseException as err:  # noqa: BLE001 - reported below; the group must not hang
            errors.append(err)
            group.abort(str(err))
        stats[i] = (compute, time.perf_counter() - t0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(nodes)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(JOIN_TIMEOUT_S)
    if errors:
        raise errors[0]
    compute = sum(c for c, _ in stats)
    wall = sum(w for _, w in stats)
    n_params = trainers[0].n_params
    steps = trainers[0].step
    ddp = ddp_bytes(n_params, nodes, steps)
    return {
        "algo": cfg.sync.algorithm,
        "codec": "demo_dct" if cfg.sync.algorithm == "demo" else cfg.sync.codec,
        "nodes": nodes,
        "link_mbps": mbps,
        "latency_ms": latency_ms,
        "compute_utilization": round(compute / wall, 4),
        "bytes_per_node": trainers[0].sync.bytes.total_sent,
        "ddp_bytes_per_node": ddp,
        "inner_steps": cfg.sync.inner_steps,
        "fragments": cfg.sync.fragments if cfg.sync.algorithm == "streaming" else 1,
        "overlap_steps": cfg.sync.overlap_steps if cfg.sync.algorithm == "streaming" else 0,
        "steps_per_node": steps,
        "n_params": n_params,
        "seconds_per_step": round(wall / nodes / steps, 4),
    }


def base_config(data: Path, inner_steps: int, preset: str) -> dict:
    return {
        "name": "utilization",
        "model": {"preset": preset, "seq_len": 128},
        "data": {"path": str(data), "tokenizer": "byte"},
        "optim": {"lr": 1e-3, "warmup_steps": 10},
        "train": {"steps": 10_000, "batch_size": 8},
        "sync": {"inner_steps": inner_steps, "overlap_steps": 5, "fragments": 4},
    }


# -- processes on shaped links ------------------------------------------------------------------

HOST_IP = "10.77.0.254"  # the host's address on the benchmark bridge: the coordinator and its DHT
PROCESS_PLANS = [("diloco", "int8"), ("streaming", "int8"), ("demo", "fp32")]


def process_row(args, data: Path, work: Path, algo: str, codec: str, mbps: int) -> dict:
    """One configuration: a coordinator and ``args.nodes`` daemons in shaped namespaces."""
    import exchange as shaped  # benchmarks/exchange.py: the namespaces and their shaping

    from murmur.node.daemon.state_dir import read_rounds
    from murmur.node.testnet.procs import Testnet, wait_for

    raw = base_config(data, args.inner_steps, args.preset)
    raw["sync"].update(algorithm=algo, codec=codec)
    # Validation only at the end of the schedule, which a row never reaches: it is neither compute
    # nor communication, and at the default eval_every (100 steps, every 3rd round at H=30) its
    # 4-5 s between windows took ~3% of a node's wall time on the 2-core machine.
    raw["train"]["eval_every"] = raw["train"]["steps"]
    cfg = config_from_dict(raw)
    root = work / f"{algo}-{codec}-{mbps}"
    root.mkdir(parents=True)
    config = root / "run.toml"
    config.write_text(cfg.to_toml())
    shaped.net_up(args.nodes, "")
    shaped.set_rate(args.nodes, mbps)
    shaped.sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", shaped.BRIDGE)
    net = Testnet(root=root, config_path=config, data=data, threads=1,
                  node_args=["--round-timeout", "300", "--min-peers", str(args.nodes)])
    net.coordinator_args = ["--dht", "--dht-listen", f"{HOST_IP}:0", "--node-listen", f"{HOST_IP}:0"]
    want = args.warmup_rounds + args.rounds
    try:
        with net:
            net.start_coordinator(listen=f"{HOST_IP}:0")
            net.create_run(token_uses=args.nodes)
            nodes = [
                net.add_node(extra=["--listen", f"{shaped.SUBNET.format(i + 1)}:0"],
                             prefix=["ip", "netns", "exec", shaped.NS.format(i)])
                for i in range(args.nodes)
            ]

            def done() -> bool:
                for n in nodes:
                    if n.proc is not None and n.proc.poll() is not None:
                        raise SystemExit(f"error: {n.name} exited with {n.proc.returncode}: see {n.log_path}")
                return all(sum(1 for r in read_rounds(n.state_dir) if "loss" in r) >= want for n in nodes)

            wait_for(done, args.row_timeout, poll_s=1.0, what=f"{want} rounds on every node")
            net.stop_nodes()
    finally:
        shaped.net_down(args.nodes)
    compute = wall = waited = 0.0
    per_node, hashes = [], []
    for n in nodes:
        recs = sorted((r for r in read_rounds(n.state_dir) if "loss" in r), key=lambda r: r["round"])
        kept = recs[args.warmup_rounds:]
        c = sum(r["compute_seconds"] for r in kept[1:])
        x = sum(r["exchange_wait_seconds"] for r in kept[1:])  # training blocked on the exchange
        w = kept[-1]["time"] - kept[0]["time"]
        compute, wall, waited = compute + c, wall + w, waited + x
        per_node.append({"rounds": len(recs), "compute_utilization": round(c / w, 4),
                         "exchange_wait_share": round(x / w, 4),
                         "peers": max(r["peers"] for r in kept), "bytes_sent": recs[-1]["bytes_sent"]})
        hashes.append({r["round"]: r["hash"] for r in recs})
    common = set.intersection(*(set(h) for h in hashes))
    agree = sum(1 for k in common if len({h[k] for h in hashes}) == 1)
    return {
        "mode": "processes",
        "algo": algo,
        "codec": "demo_dct" if algo == "demo" else codec,
        "nodes": args.nodes,
        "link_mbps": mbps,
        "latency_ms": None,
        "compute_utilization": round(compute / wall, 4),
        "exchange_wait_share": round(waited / wall, 4),
        "validation": "off (train.eval_every = train.steps)",
        "inner_steps": cfg.sync.inner_steps,
        "fragments": cfg.sync.fragments if algo == "streaming" else 1,
        "overlap_steps": cfg.sync.overlap_steps if algo == "streaming" else 0,
        "rounds_measured": args.rounds,
        "hash_agreement": f"{agree}/{len(common)} rounds",
        "per_node": per_node,
        "load": shaped.load(),
    }


def main_processes(args) -> int:
    if os.geteuid() != 0:
        raise SystemExit("error: --mode processes needs root (network namespaces and tc): run it with sudo")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    data = Path(args.data)
    if not (data / "manifest.json").is_file():
        prepare(data, tokenizer="byte")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="murmur-util-") as tmp:
        for mbps in [int(float(x)) for x in args.link_mbps.split(",")]:
            for algo, codec in PROCESS_PLANS:
                row = process_row(args, data, Path(tmp), algo, codec, mbps)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_process_rows(args, rows)  # after every row: a run cut short keeps its rows
    return 0


def write_process_rows(args, rows: list[dict]) -> None:
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {"rows": []}
    threads = [dict(r, mode=r.get("mode", "threads")) for r in old.get("rows", []) if r.get("mode") != "processes"]
    old.setdefault("thread_rows", {k: old[k] for k in ("device", "date", "command", "notes") if k in old})
    old["processes"] = {
        "device": f"cpu: {platform.machine()}, {os.cpu_count()} cores shared by {args.nodes} node processes "
        "(1 torch thread each) and the coordinator",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "sudo .venv/bin/python benchmarks/utilization.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "notes": "real node daemons in network namespaces, uploads shaped by tc tbf (no added latency), the "
        "gRPC exchange and the hivemind DHT; compute = the nodes' own compute_seconds, wall = time between "
        f"their round records, the first {args.warmup_rounds} rounds left out; validation off (only at the end of "
        "the schedule, which a row never reaches): it is neither compute nor communication; exchange_wait_share = "
        "the time training was blocked on the exchange, over the same wall; the machine's cores are shared "
        "by every node, so a node computes slower than it would alone, and its exchange work competes with its compute",
    }
    old["rows"] = threads + rows
    out.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


def kept_process_rows(path: Path) -> list[dict]:
    """The process rows of an earlier --mode processes run (a thread run keeps them)."""
    if not path.is_file():
        return []
    return [r for r in json.loads(path.read_text()).get("rows", []) if r.get("mode") == "processes"]


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("threads", "processes"), default="threads")
    p.add_argument("--rounds", type=int, default=8, help="processes: measured rounds per node")
    p.add_argument("--warmup-rounds", type=int, default=1, help="processes: first rounds not counted")
    p.add_argument("--row-timeout", type=float, default=900.0, help="processes: seconds one row may take")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--link-mbps", default="100", help="Mbit/s (processes: a comma-separated list)")
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--inner-steps", type=int, default=30, help="H")
    p.add_argument("--windows", type=int, default=3, help="outer rounds per configuration")
    p.add_argument("--preset", default="small", help="model preset (small: 4.9M parameters)")
    p.add_argument("--data", default=str(ROOT / "data" / "shakespeare-byte"))
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 1 window, nothing written")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.mode == "processes":
        return main_processes(args)
    data = Path(args.data)
    if not (data / "manifest.json").is_file():
        prepare(data, tokenizer="byte")
    dataset = Dataset.open(data)
    preset, windows, h = ("tiny", 1, 5) if args.quick else (args.preset, args.windows, args.inner_steps)
    rows = []
    plans = [
        ("diloco", "fp32"),
        ("diloco", "int4"),
        ("streaming", "fp32"),
        ("streaming", "int4"),
        ("demo", "fp32"),
    ]
    for algo, codec in plans:
        raw = base_config(data, h, preset)
        raw["sync"].update(algorithm=algo, codec=codec)
        if args.quick:
            raw["sync"]["overlap_steps"] = 1
        cfg = config_from_dict(raw)
        # DeMo syncs every step: fewer steps keep its run as long as the others'.
        row = run_config(cfg, dataset, args.nodes, float(args.link_mbps), args.latency_ms, windows)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.quick:
        return 0
    out = {
        "device": f"cpu: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads "
        f"available, {args.nodes} nodes as threads with 1 torch thread each",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(
            [Path(sys.executable).name, "benchmarks/utilization.py", *(argv or sys.argv[1:])]
        ),
        "notes": "Emulated link per node (token bucket at link_mbps, full duplex, 2 one-way latencies per "
        "round) behind the in-process exchange; compute = forward+backward+optimizer seconds, "
        "utilization = compute / wall summed over nodes. Streaming DiLoCo launches each fragment's "
        "exchange and trains overlap_steps more steps before applying it. Target: >= 0.95 with "
        "Streaming DiLoCo's overlap (OpenDiLoCo reports 0.90-0.95).",
        "rows": [dict(r, mode="threads") for r in rows] + kept_process_rows(Path(args.out)),
    }
    if kept_process_rows(Path(args.out)):
        out["processes"] = json.loads(Path(args.out).read_text())["processes"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
