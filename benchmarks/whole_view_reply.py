"""The coordinator's CPU for one heartbeat reply that lists the whole live-trainer view.

    python benchmarks/whole_view_reply.py --members 10000

A real view (coordinator/trainer_view.py: ``--members`` trainers with 27-character node ids as
the coordinator issues them, an incarnation, an address, a round and a 64-character state hash)
and a reply with the other fields a heartbeat reply carries (run state, interval, TTLs, start
time, version, the datagram address and key), made into the bytes gRPC sends, two ways:

* ``built``: the reply extended with the view's members and serialized, per reply (before:
  ``reply.members.extend(view.members)``, then gRPC's serializer);
* ``bytes``: the reply's other fields serialized and the view's members appended as the bytes it
  serialized once for its version (``View.members_field``, coordinator/preserialized.py's
  ``BeatReply.wire``); the once-per-version cost is its own row (``members_field_once``), beside
  the view's rebuild itself (``view_rebuild_once``: the live trainers read and listed).

Both are checked to parse to the same reply. CPU of this thread (time.thread_time) per reply, the
best of ``--repeat`` passes of ``--replies`` replies, so a loaded machine's stolen time shows less.
Writes benchmarks/results/whole_view_reply.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "whole_view_reply.json"


def measure(members: int, replies: int, repeat: int) -> list[dict[str, object]]:
    from murmur.coordinator.preserialized import BeatReply
    from murmur.coordinator.trainer_view import TrainerViews
    from murmur.coordinator.trainers import Trainers
    from murmur.protocol import coordinator_pb2 as pb

    trainers = Trainers(settle_s=0.0)
    for i in range(members):
        node_id = secrets.token_hex(14)[:27]
        trainers.update(node_id, "run", secrets.token_hex(8), f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:7800",
                        1000 + i % 7, secrets.token_hex(32))
    rebuild = once = float("inf")
    for _ in range(repeat):  # a rebuild, as after a trainer came or went, and its bytes made once
        views = TrainerViews(trainers, lambda run: trainers.live(run, lambda n: True), 1.0)
        t0 = time.thread_time()
        view = views.get("run")
        t1 = time.thread_time()
        field_bytes = view.members_field()
        rebuild, once = min(rebuild, t1 - t0), min(once, time.thread_time() - t1)

    def rest() -> pb.HeartbeatReply:  # what every reply carries beside the view
        return pb.HeartbeatReply(run_state="active", heartbeat_interval_s=1.0, lease_ttl_s=100.0,
                                 coordinator_started_at=time.time(), view_version=view.version, run_round=1003,
                                 view_whole=True, heartbeat_udp_address="203.0.113.7:7703",
                                 heartbeat_udp_key=b"k" * 32)

    def built() -> bytes:
        reply = rest()
        reply.members.extend(view.members)
        return reply.SerializeToString()

    def assembled() -> bytes:
        return BeatReply(rest(), view.members_field()).wire()

    old, new = pb.HeartbeatReply.FromString(built()), pb.HeartbeatReply.FromString(assembled())
    new.coordinator_started_at = old.coordinator_started_at  # the one field that differs: its time
    assert old == new and len(old.members) == members

    rows: list[dict[str, object]] = [
        {"members": members, "way": "view_rebuild_once", "ms": round(1e3 * rebuild, 3)},
        {"members": members, "way": "members_field_once", "ms": round(1e3 * once, 3), "bytes": len(field_bytes)},
    ]
    for way, make in (("built", built), ("bytes", assembled)):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.thread_time()
            for _ in range(replies):
                data = make()
            best = min(best, (time.thread_time() - t0) / replies)
        rows.append({"members": members, "way": way, "ms_per_reply": round(1e3 * best, 3), "bytes": len(data)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--replies", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = measure(args.members, args.replies, args.repeat)
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
            "load_avg_1m": round(load, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "notes": "the coordinator's CPU (this thread) for one heartbeat reply listing the whole view, as the "
                     "bytes gRPC sends: 'built' extends the reply with the members and serializes it (before), "
                     "'bytes' serializes the other fields and appends the view's members serialized once per "
                     "version (after; 'members_field_once' is that once, 'view_rebuild_once' the view's own "
                     "rebuild). Best of the passes; no gRPC, no TLS.",
            "rows": rows,
        }, indent=1) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
