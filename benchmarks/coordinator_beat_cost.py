"""The coordinator's own CPU for one heartbeat and one commit, without gRPC: what its process
spends on a beat a heartbeat front hands it (coordinator/fronts.py), parse and reply included, and
on a commit's ledger rules and reply.

    python benchmarks/coordinator_beat_cost.py --nodes 2000 --rounds 5

A real coordinator (its ledger, membership, trainer view, kept state and recovery flags) in this
process, ``--nodes`` nodes really joined (token, CSR, certificate), then every node's heartbeat
answered ``--rounds`` times as the link answers it (``CoordinatorService.front_beat``: parse,
membership, the reply, serialize), as a plain node and as a trainer whose view is unchanged. Then
each node, holding a lease on its own shard of the run's ``--nodes`` shards, commits ``--rounds``
times what a Commit's handler runs (Leases.commit and the run's committed tokens for the reply), in
batches of 100 sharing a transaction as group commit batches them (coordinator/group_commit.py;
its fsync, off the loop thread, not counted). The
CPU of the answering thread (time.thread_time) over the beats; the best of ``--repeat`` passes, so a
loaded machine's stolen time shows less. At 10,000 heartbeats a second, each microsecond here is
1% of a core of the coordinator's own process. Writes benchmarks/results/coordinator_beat_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "coordinator_beat_cost.json"


async def measure(nodes: int, rounds: int, repeat: int) -> list[dict[str, object]]:
    from murmur.coordinator.server import Coordinator, ServeOptions
    from murmur.coordinator.settings import CoordinatorSettings
    from murmur.protocol import coordinator_pb2 as pb
    from murmur.protocol import identity

    tmp = Path(tempfile.mkdtemp(prefix="murmur-beat-cost-"))
    settings = CoordinatorSettings(heartbeat_ttl_s=3600, lease_ttl_s=3600, join_grace_s=3600)
    coord = Coordinator(ServeOptions(db=tmp / "c.db", listen="127.0.0.1:0", node_listen="127.0.0.1:0",
                                     metrics_listen="off", settings=settings))
    await coord.start()
    try:
        manifest = json.dumps({"shards": [{"id": i, "tokens": 10**9} for i in range(nodes)]})
        run_id = coord.runs.create('name = "cost"\n[model]\npreset = "tiny"\n', manifest)
        token = coord.runs.create_token(run_id, 3600, nodes, "").token
        # A key each: a join with a key the ledger knows is that node's rejoin (one key for all, as
        # this benchmark once had it, measured one node beating ``nodes`` times).
        ids = [coord.membership.join(token, identity.make_csr(identity.generate_key()), {}, "", "").node_id
               for _ in range(nodes)]
        assert len(set(ids)) == nodes
        coord.membership.view_from(0.0)  # the view is whole now (no restart to wait out)
        service = coord.service
        kinds = {
            "node": [pb.HeartbeatRequest(tokens_per_s=1.0).SerializeToString() for _ in ids],
            "trainer": [pb.HeartbeatRequest(tokens_per_s=1.0, incarnation="i", peer_address=f"10.0.0.1:{i + 1}",
                                            round=1, state_hash="ab" * 32).SerializeToString() for i in range(nodes)],
        }
        rows = []
        for kind, requests in kinds.items():
            version = 0
            for n, r in zip(ids, requests, strict=True):  # first beats: the trainers come into the view
                service.front_beat(n, r)
            if kind == "trainer":  # from now on each trainer holds the current view
                version = pb.HeartbeatReply.FromString(service.front_beat(ids[0], requests[0]).reply).view_version
                requests = [pb.HeartbeatRequest(tokens_per_s=1.0, incarnation="i", peer_address=f"10.0.0.1:{i + 1}",
                                                round=1, state_hash="ab" * 32, view_version=version,
                                                ban_list_version=service.membership.ban_version).SerializeToString()
                            for i in range(nodes)]
            best = float("inf")
            for _ in range(repeat):
                t0 = time.thread_time()
                for _ in range(rounds):
                    for n, r in zip(ids, requests, strict=True):
                        answer = service.front_beat(n, r)
                best = min(best, (time.thread_time() - t0) / (rounds * nodes))
            assert not answer.code, answer.details
            rows.append({"nodes": nodes, "beat": kind, "us_per_beat": round(1e6 * best, 2),
                         "reply_bytes": len(answer.reply), "view_unchanged": kind == "trainer"})
        rows.append(_commit_row(coord, run_id, ids, rounds, repeat))
        return rows
    finally:
        await coord.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _commit_row(coord, run_id: str, ids: list[str], rounds: int, repeat: int) -> dict[str, object]:
    from murmur.coordinator.leases import Progress

    store, leases = coord.store, coord.membership.leases
    held = [leases.acquire(run_id, n)[0] for n in ids]
    assert len({h.shard_id for h in held}) == len(ids)  # a shard each
    offset, best = 0, float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        for _ in range(rounds):
            p = Progress(outer_step=offset // 100 + 1, loss=2.0, bytes_sent=10, seconds=1.0)
            for start in range(0, len(ids), 100):
                with store.write(durable=False):
                    for n, lease in zip(ids[start:start + 100], held[start:start + 100], strict=True):
                        leases.commit(run_id, n, lease.lease_id, lease.shard_id, offset, offset + 100, p)
                        store.run_totals(run_id)["tokens_committed"]
            offset += 100
        best = min(best, (time.thread_time() - t0) / (rounds * len(ids)))
    assert store.run_totals(run_id)["tokens_committed"] == offset * len(ids)
    return {"nodes": len(ids), "shards": len(ids), "call": "commit", "us_per_commit": round(1e6 * best, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = asyncio.run(measure(args.nodes, args.rounds, args.repeat))
    for row in rows:
        print(json.dumps(row), flush=True)
    if not args.no_write:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
        RESULTS.write_text(json.dumps({
            "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU only)",
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "load_avg_1m": round(load, 2),
            "notes": "the coordinator's own CPU (its answering thread) per heartbeat handed over by a front: "
                     "parse, membership, reply, serialize; and per commit: the ledger's rules and the run's "
                     "committed tokens, 100 commits a transaction, no fsync; no gRPC. Best of the passes.",
            "rows": rows,
        }, indent=1) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
