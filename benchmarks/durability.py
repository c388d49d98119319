"""What keeping the run's state costs the coordinator, how fast a joiner restores from it, and how
the durability scenarios end (issue 50; coordinator/keeper.py, docs/failure-model.md).

    python benchmarks/durability.py                      # keeper cost (tiny, base), scenarios
    python benchmarks/durability.py --presets tiny --no-scenarios

1. ``keep_cost``: for each preset, a peer server (node/net/server.py, mutual TLS on loopback)
   publishes a data-parallel run's shared state (the global weights and the outer momentum, fp32:
   what a node serves as ``state/<r>``), and the coordinator's own path pulls it as its keeper
   does (protocol/state_client.py: GetState as raw bytes, hash-checked) and writes it beside a
   ledger (coordinator/kept_state.py: atomic, checksummed, ``keep.versions`` kept). Rows: bytes a
   pull, seconds a pull (fetch, write), disk kept, and the bytes an hour at ``keep.every_s`` (the
   keeper pulls at most once an interval, and only when the run moved on: an upper bound).
2. ``scenarios`` (tiny testnet config, real processes, the steps of their tests:
   tests/_durable_scenarios.py): two nodes train and stop (one SIGKILL, one SIGTERM) and a node
   with a fresh folder joins: seconds from its start to the restored kept state and to its first
   round; the same with nothing kept: the run waits for the operator, then goes on after `admin
   runs recover`; a coordinator SIGKILL and restart, then a node restarted with --min-peers 3:
   seconds until it met its peers; a pipelined run (2 stages) whose stage peers all stopped, and
   two stage peers with fresh folders: seconds from each one's start to its stage restored from
   the coordinator's kept set, and to serving.

The machine is shared: the JSON states the load.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "durability.json"
EVERY_S = 60.0  # keep.every_s's default
VERSIONS = 2  # keep.versions's default


def _shared_state(preset: str):
    """A node's published shared state for ``preset``: global weights + outer momentum + counters."""
    import torch

    from murmur.node.model.transformer import Transformer, model_config

    cfg = model_config(preset)
    with torch.device("cpu"):
        model = Transformer(cfg)
    tensors = [(f"global/{n}", p.detach()) for n, p in model.named_parameters()]
    tensors += [(f"outer/0/{i}", torch.zeros_like(p)) for i, (_, p) in enumerate(model.named_parameters())]
    tensors.append(("counters", torch.tensor([100, 2], dtype=torch.int64)))
    return tensors, sum(p.numel() for p in model.parameters())


async def _keep_cost(preset: str, pulls: int) -> dict:
    from murmur.coordinator import kept_state
    from murmur.coordinator.kept_state import KeptVersion
    from murmur.node.net.server import PeerServer, PublishedState
    from murmur.protocol.identity import CertificateAuthority
    from murmur.protocol.state_client import fetch_raw
    from murmur.protocol.wire import tensors_hash

    ca = CertificateAuthority.create("bench")
    node, keeper = ca.issue(), ca.issue()
    server = PeerServer(node, run_id="bench")
    await server.start()
    tensors, n_params = _shared_state(preset)
    digest = tensors_hash(tensors)
    server.publish_state(PublishedState("state/1", tensors, digest))
    fetch_s, write_s, nbytes, disk = [], [], 0, 0
    with tempfile.TemporaryDirectory(prefix="murmur-keep-") as tmp:
        db = Path(tmp) / "coordinator.db"
        for i in range(pulls):
            t0 = time.perf_counter()
            state = await fetch_raw(keeper, {node.node_id: server.address}, "state/1", digest)
            t1 = time.perf_counter()
            version = KeptVersion(run_id="bench", round=i + 1, states=[state], kept_at=time.time())
            await asyncio.to_thread(kept_state.write, db, version, VERSIONS)
            t2 = time.perf_counter()
            fetch_s.append(t1 - t0)
            write_s.append(t2 - t1)
            nbytes = state.nbytes
            del state, version
        disk = kept_state.disk_bytes(db, "bench")
        t0 = time.perf_counter()
        back = kept_state.newest(db, "bench")
        read_s = time.perf_counter() - t0
        assert back is not None and back.states[0].state_hash == digest
    await server.stop()
    per_pull = min(f + w for f, w in zip(fetch_s, write_s, strict=True))
    return {
        "preset": preset, "params": n_params, "bytes_per_pull": nbytes, "pulls": pulls,
        "fetch_s_min": round(min(fetch_s), 3), "write_s_min": round(min(write_s), 3),
        "seconds_per_pull_min": round(per_pull, 3), "seconds_per_pull_max": round(max(
            f + w for f, w in zip(fetch_s, write_s, strict=True)), 3),
        "read_and_check_s": round(read_s, 3),
        "disk_kept_bytes": disk, "versions": VERSIONS, "every_s": EVERY_S,
        "bytes_pulled_per_hour_max": int(nbytes * 3600 / EVERY_S),
        "busy_share_max": round(per_pull / EVERY_S, 5),  # of one core, at one pull an interval
    }


def _scenarios(data: Path) -> list[dict]:
    """The durability scenarios, step for step as their tests run them (tests/_durable_scenarios.py)."""
    sys.path.insert(0, str(REPO / "tests"))
    import _durable_scenarios as sc
    from _node_helpers import trained

    rows = []
    with tempfile.TemporaryDirectory(prefix="murmur-durability-") as tmp:
        # 1. every node gone, the coordinator keeps the state: a fresh joiner restores it
        net = sc.kept_net(Path(tmp) / "kept", data)
        with net:
            _, newest = sc.train_then_all_gone(net)
            got = sc.join_and_restore(net)
            first = int(trained(got.node)[0]["round"])
            rows.append({
                "scenario": "every node gone (SIGKILL + SIGTERM), state kept; a fresh folder joins",
                "run_round": newest, "restored_round": got.round, "restore_s": got.restore_s,
                "first_round_s": got.first_round_s, "first_round": first,
                "outcome": "restored the kept state (hash verified) and trained the run's next round"
                if got.round == newest and first == newest + 1 else "other",
            })
            net.stop_node(got.node)
        # 2. nothing kept: the run waits for the operator
        net = sc.lost_net(Path(tmp) / "lost", data)
        with net:
            b, _, waiting_s = sc.train_alone_then_lost(net)
            trained_before = len(trained(b))
            after = sc.recover(net, b, "scratch")
            rows.append({
                "scenario": "every node gone, nothing kept (keep.every_s = 0); a fresh folder joins",
                "waiting_after_s": waiting_s, "rounds_trained_while_waiting": trained_before,
                "after_recover_first_round_s": after,
                "outcome": "waited for the operator (state_lost), then went on as the run's round after recover"
                if trained_before == 0 else "other",
            })
            net.stop_node(b)
        # 3. coordinator SIGKILL and restart, then a node restarted with --min-peers 3
        net = sc.dht_net(Path(tmp) / "dht", data)
        with net:
            _, _, met, met_s = sc.restart_coordinator_then_a_node(net)
            rows.append({
                "scenario": "coordinator SIGKILL + restart, then a node restarted with --min-peers 3",
                "peers_met": met, "met_peers_after_dataplane_s": round(met_s, 2) if met_s is not None else None,
                "outcome": "met its peers within seconds" if met_s is not None and met_s < 15 and met >= 3
                else "waited",
            })
        # 4. pipelined: every stage peer gone, the coordinator keeps the stages; new peers restore them
        root = Path(tmp) / "pipeline"
        root.mkdir()
        with sc.pipeline_net(root, data) as (net, join):
            peers, new = [], []
            try:
                sc.pipeline_trained_then_gone(net, join, root, data, peers)
                final = {p.stopped["stage"]: p.stopped["state_hash"] for p in peers}
                new = [sc.join_stage_peer(root, join, f"new{i}") for i in range(2)]
            finally:
                sc.stop_all(peers)
                sc.stop_all([n.peer for n in new])
            same = all(n.peer.ready["state_source"] == "kept" and n.peer.ready["state_hash"] ==
                       final[n.peer.ready["stage"]] for n in new)
            rows.append({
                "scenario": "pipelined (2 stages): every stage peer gone, stages kept; fresh stage peers join",
                "run_step": sc.STEPS, "restore_s": [n.restore_s for n in new], "ready_s": [n.ready_s for n in new],
                "outcome": "each restored its stage from the kept set (the stopped peers' hashes) and served"
                if same else "other",
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,base")
    ap.add_argument("--pulls", type=int, default=3)
    ap.add_argument("--no-scenarios", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    began = time.time()
    keep = [asyncio.run(_keep_cost(p, args.pulls)) for p in args.presets.split(",") if p]
    scenarios = []
    if not args.no_scenarios:
        from murmur.node.model.data import prepare

        with tempfile.TemporaryDirectory(prefix="murmur-durability-data-") as d:
            data = Path(d) / "data"
            prepare(data, tokenizer="byte", shard_tokens=8192)
            scenarios = _scenarios(data)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    out = {
        "benchmark": "durability",
        "device": f"cpu ({platform.machine()}), shared by other jobs",
        "load": list(os.getloadavg()),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/durability.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit,
        "wall_s": round(time.time() - began),
        "rows": keep,
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
