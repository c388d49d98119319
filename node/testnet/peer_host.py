"""Several exchange peers in one process: how benchmarks/scale.py fits 64 real peers on 2 cores.

    python -m murmur.node.testnet.peer_host --identity DIR [--identity DIR ...] --run RUN \
        --bootstrap MADDR --peers N --rounds R --numel 2000000 --codec int4 [--set sync.group_size=8]

Each peer is what node/testnet/exchange_peer_process.py runs, built the same way (node/exchange/
peer.py): its own identity, its own TLS peer server on its own socket, its own GrpcExchange, its
own DHT records and rendezvous entries signed with its own key. What the peers of one process
share is the process: its event loop and one DHT process with its p2pd (``MurmurDHT.signing_as``),
instead of two helper processes a peer. One peer to a process is exactly exchange_peer_process.

``--set section.key=value`` are run-config overrides (protocol/runconfig.py), checked as a node
checks its run's TOML: ``--set sync.group_size=G`` is how a run bounds its round groups, and a
tree whose run config has no such key refuses it in one line.

Protocol with the driver: one ``{"event": "ready", ...}`` line per peer once its server listens
and its record is announced; then the rounds start when a line arrives on stdin (the driver starts
every process at once); then one ``{"event": "round", ...}`` line per peer and round, with the
wall-clock start and end (``t0``, ``t1``: Unix seconds, comparable across processes), the bytes
the peer sent, the result's hash, or the error. Exits cleanly on SIGTERM, leaving no p2pd behind.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import sys
import time
from typing import Any

import torch

from murmur.errors import MurmurError
from murmur.library_logs import DEBUG_ENV
from murmur.node.exchange.group import DHTGroup, RendezvousSettings
from murmur.node.exchange.peer import ExchangePeer, PeerSpec, build_peer
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.loop import LoopThread
from murmur.node.net.server import PeerServerSettings
from murmur.node.testnet.exchange_peer_process import announce, emit, live_peers, update_for, wait_for_records
from murmur.optim.codecs import make_codec
from murmur.protocol.dht import DHTError, DHTSettings, MurmurDHT, PeerRecord
from murmur.protocol.identity import Identity
from murmur.protocol.runconfig import RunConfig, apply_override, config_from_dict
from murmur.protocol.wire import tensors_hash

try:  # bounded groups (sync.group_size): a tree from before them runs every round as one group
    from murmur.node.exchange.hierarchy import GroupedExchange
except ImportError:
    GroupedExchange = None

# Worker threads of the shared loop: each peer's rendezvous polls the DHT from a thread of its own
# (asyncio.to_thread), as it would in its own process; asyncio's default pool (6 threads on 2
# cores) would make the peers of one process wait on each other's polls.
THREADS_PER_PEER = 4


def run_config(overrides: list[str]) -> RunConfig:
    """The run config the peers act on: the defaults plus ``--set`` overrides, checked."""
    data: dict[str, Any] = {}
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data)


def group_size(cfg: RunConfig) -> int | None:
    """The run's bound on a round group (None where the run config has none: one group of all)."""
    size = getattr(cfg.sync, "group_size", None)
    return None if size is None or GroupedExchange is None else int(size)


def log_to_stderr() -> None:
    """The exchange's own lines (who was dropped, what was retried or caught up) on stderr, at
    MURMUR_LOG_LEVEL (info, debug) when set: benchmarks/scale.py --keep-logs keeps them. Each line
    names its thread, not its peer: peers of one process share the loop."""
    level = os.environ.get(DEBUG_ENV, "").strip().upper()
    if level in ("DEBUG", "INFO"):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        murmur_log = logging.getLogger("murmur")
        murmur_log.addHandler(handler)
        murmur_log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.testnet.peer_host")
    ap.add_argument("--identity", action="append", required=True, help="a peer's folder (node.key, node.crt, ca.crt)")
    ap.add_argument("--run", default="murmur-run")
    ap.add_argument("--bootstrap", action="append", default=[], help="DHT multiaddr to join (repeatable)")
    ap.add_argument("--peers", type=int, required=True, help="how many peers the first round waits for")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override")
    ap.add_argument("--peer-timeout", type=float, default=10.0)
    ap.add_argument("--round-deadline", type=float, default=120.0)
    ap.add_argument("--rendezvous-deadline", type=float, default=60.0)
    ap.add_argument("--record-ttl", type=float, default=60.0)  # as exchange_peer_process
    ap.add_argument("--host", default="127.0.0.1", help="address the peer servers and the DHT listen on")
    args = ap.parse_args(argv)
    try:
        cfg = run_config(args.set)
    except MurmurError as err:
        print(f"peer_host: {err}", file=sys.stderr)
        return 2
    bound = group_size(cfg)
    log_to_stderr()
    torch.set_num_threads(1)  # many peers share 2 cores: one torch thread each, as `--threads 1`
    identities = [Identity.load(d) for d in args.identity]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loop = LoopThread()
    loop.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(THREADS_PER_PEER * len(identities) + 4))
    dht = MurmurDHT(args.run, ca_cert_pem=identities[0].ca_cert_pem, identity=identities[0],
                    initial_peers=args.bootstrap, settings=DHTSettings(host=args.host, record_ttl=args.record_ttl))
    peers: list[ExchangePeer] = []
    try:
        dht.start()
        handles = [dht if i == 0 else dht.signing_as(ident) for i, ident in enumerate(identities)]
        first_round = True

        def expected() -> int:
            # As exchange_peer_process: the first round waits for --peers, later ones for the live
            # peers as the round found them (live_peers: alive records, dead addresses left out).
            return args.peers if first_round else len(live)

        rendezvous = RendezvousSettings(deadline=args.rendezvous_deadline)
        settings = ExchangeSettings(peer_timeout=args.peer_timeout, round_deadline=args.round_deadline)
        for ident, handle in zip(identities, handles, strict=True):
            spec = PeerSpec(
                identity=ident,
                run_id=args.run,
                codec=make_codec(args.codec),
                group=lambda address, h=handle: DHTGroup(h, address, expected=expected, settings=rendezvous),
                settings=settings,
                server=PeerServerSettings(host=args.host),
            )
            peers.append(build_peer(spec, loop))
        records = [PeerRecord(node_id=p.node_id, address=p.address) for p in peers]
        # As exchange_peer_process: with bounded groups, each peer's exchange forms the round's
        # groups from the live peers' records, read before each round (never on the loop).
        live: list[str] = []
        seen: dict[str, str] = {}  # the live peers of the round before, with their addresses
        exchanges = [p.exchange if bound is None else
                     GroupedExchange(p.exchange, run_id=args.run, live=lambda: live, group_size=bound,
                                     addresses=lambda: seen) for p in peers]
        for handle, record in zip(handles, records, strict=True):
            handle.announce(record)
            emit(event="ready", node_id=record.node_id, address=record.address, group_size=bound)
        sys.stdin.readline()  # the driver's go: every process starts its rounds at once
        if bound is not None and args.peers > bound:  # the first round's groups need every record
            seen = wait_for_records(dht, [], args.peers, args.rendezvous_deadline, args.record_ttl)
        for r in range(1, args.rounds + 1):
            for handle, record in zip(handles, records, strict=True):
                announce(handle, record)  # re-announce every round: the record lives record_ttl seconds
            seen = live_peers(dht, {r.node_id for r in records}, seen)
            live[:] = list(seen)
            calls = {}
            for p, exchange in zip(peers, exchanges, strict=True):
                t0 = time.time()
                x = update_for(p.node_id, r, args.numel)
                calls[exchange.all_reduce([x], round_id=r, key="update")] = (p.node_id, t0)
            for done in concurrent.futures.as_completed(calls):
                node_id, t0 = calls[done]
                try:
                    res = done.result()
                except Exception as err:  # noqa: BLE001 - reported, and the next round goes on
                    emit(event="round", node_id=node_id, round=r, ok=False, error=str(err)[:300],
                         t0=t0, t1=time.time())
                    continue
                emit(event="round", node_id=node_id, round=r, ok=True, members=len(res.members),
                     dropped=len(res.dropped), hash=tensors_hash([("0", res.tensors[0])]).hex(),
                     bytes_sent=res.bytes_sent, t0=t0, t1=time.time())
            first_round = False
        for handle in handles:
            try:  # a goodbye only: on a DHT too busy to take it, the records expire with their TTL
                handle.withdraw()
            except DHTError as err:
                print(f"peer_host: could not withdraw {handle.identity.node_id}: {err}", file=sys.stderr)
        return 0
    finally:
        for p in peers:
            loop.run(p.aclose())
        loop.stop()
        dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
