"""One exchange peer as a process: the tests' SIGKILL and multi-process runs, and a manual check.

    python -m murmur.node.testnet.exchange_peer_process --identity DIR --run RUN --bootstrap MADDR \
        --peers 4 --rounds 3 --numel 65536 --codec int8 [--chunk-mb 4] [--fault exit@2] \
        [--fault exit_midstream@2] [--fault lose_result@2] [--set sync.group_size=8] [--result-dir DIR]

It joins the run's DHT, starts its TLS peer server, announces itself, and for each round meets
the others at the DHT rendezvous and all-reduces a deterministic update (seeded by node id and
round), printing one JSON line per round: the members (a grouped round's: the whole round's,
``group``: its own group's survivors), who was dropped and why, whether the
result was fetched from peers (caught up), and the result's hash. Faults (node/net/faults.py)
make it misbehave on purpose. It exits cleanly on SIGTERM/SIGINT, leaving no p2pd behind.

``--set sync.group_size=G`` (the run-config key; other keys are checked and ignored): more live
peers than G all-reduce in groups (node/exchange/hierarchy.py); the live peers are those whose DHT
records are alive, and the first round starts once ``--peers`` of them are there, so every peer
forms the same groups. ``--result-dir`` saves each round's result as ``<node id>-<round>.pt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import time

import torch

from murmur.node.exchange.group import DHTGroup, RendezvousSettings
from murmur.node.exchange.hierarchy import GroupedExchange
from murmur.node.exchange.peer import ExchangePeer, PeerSpec, build_peer
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.train.overrides import add_set_flag, config_from_args
from murmur.optim.codecs import make_codec
from murmur.protocol.dht import DHTSettings, MurmurDHT, PeerRecord
from murmur.protocol.identity import Identity
from murmur.protocol.wire import tensors_hash


def update_for(node_id: str, round_id: int, numel: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{node_id}/{round_id}".encode()).digest()[:8], "little")
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def wait_for_records(dht: MurmurDHT, record: PeerRecord, peers: int, deadline_s: float, ttl: float) -> None:
    """Until ``peers`` records are in the DHT (or the deadline): the groups of the first round are
    formed from them, and a peer that saw fewer would form other groups than the rest. Our record
    is announced again every half TTL meanwhile: the first peers up must not expire while the
    last ones start."""
    end = announced = time.monotonic()
    end += deadline_s
    while len(dht.peers()) < peers and time.monotonic() < end:
        if time.monotonic() - announced > ttl / 2:
            dht.announce(record)
            announced = time.monotonic()
        time.sleep(0.1)


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.testnet.exchange_peer_process")
    ap.add_argument("--identity", required=True, help="folder with node.key, node.crt, ca.crt")
    ap.add_argument("--run", default="murmur-run")
    ap.add_argument("--bootstrap", action="append", default=[], help="DHT multiaddr to join (repeatable)")
    ap.add_argument("--peers", type=int, required=True, help="how many peers each round waits for")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--fault", action="append", default=[], help="fault[@round], see node/net/faults.py")
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="ExchangeSettings.chunk_mb")
    ap.add_argument("--peer-timeout", type=float, default=3.0)
    ap.add_argument("--round-deadline", type=float, default=30.0)
    ap.add_argument("--rendezvous-deadline", type=float, default=60.0)
    ap.add_argument("--record-ttl", type=float, default=5.0)
    ap.add_argument("--result-dir", default="", help="save each round's result there (tests)")
    add_set_flag(ap)
    args = ap.parse_args(argv)
    args.config = None
    group_size = config_from_args(args, {}).sync.group_size

    identity = Identity.load(args.identity)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loop = LoopThread()
    dht = MurmurDHT(
        args.run,
        ca_cert_pem=identity.ca_cert_pem,
        identity=identity,
        initial_peers=args.bootstrap,
        settings=DHTSettings(record_ttl=args.record_ttl),
    )
    peer: ExchangePeer | None = None
    try:
        dht.start()
        first_round = True

        def expected() -> int:
            # The first round waits for --peers; later ones for the peers whose records are alive
            # (a dead peer's record expires after record_ttl, so the group shrinks without it).
            return args.peers if first_round else len(dht.peers())

        rendezvous = RendezvousSettings(deadline=args.rendezvous_deadline)
        spec = PeerSpec(
            identity=identity,
            run_id=args.run,
            codec=make_codec(args.codec),
            group=lambda address: DHTGroup(dht, address, expected=expected, settings=rendezvous),
            settings=ExchangeSettings(
                peer_timeout=args.peer_timeout, round_deadline=args.round_deadline, chunk_mb=args.chunk_mb
            ),
            faults=FaultInjector.parse(args.fault),
        )
        peer = build_peer(spec, loop)
        address = peer.address
        record = PeerRecord(node_id=identity.node_id, address=address)
        dht.announce(record)
        live: list[str] = []  # read from the DHT before each round, never on the loop (a blocking get)
        exchange = GroupedExchange(peer.exchange, run_id=args.run, live=lambda: live, group_size=group_size)
        emit(event="ready", node_id=identity.node_id, address=address)
        if args.peers > group_size:
            wait_for_records(dht, record, args.peers, args.rendezvous_deadline, args.record_ttl)
        for r in range(1, args.rounds + 1):
            t0 = time.monotonic()
            dht.announce(record)  # re-announce every round: the record lives record_ttl seconds
            live[:] = [p.node_id for p in dht.peers()]
            x = update_for(identity.node_id, r, args.numel)
            try:
                res = exchange.all_reduce([x], round_id=r, key="update").result()
            except Exception as err:  # noqa: BLE001 - reported, and the next round goes on
                emit(event="round", round=r, ok=False, error=str(err))
                continue
            first_round = False
            if args.result_dir:
                torch.save(res.tensors[0], f"{args.result_dir}/{identity.node_id}-{r}.pt")
            emit(
                event="round",
                round=r,
                ok=True,
                members=res.members,
                group=exchange.last_group if exchange.last is not None and not exchange.last.single else res.members,
                dropped=res.dropped,
                fetched=(r, "update") in peer.exchange.caught_up,
                hash=tensors_hash([("0", res.tensors[0])]).hex(),
                seconds=round(time.monotonic() - t0, 3),
            )
        dht.withdraw()
        return 0
    finally:
        if peer is not None:
            loop.run(peer.aclose())
        loop.stop()
        dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
