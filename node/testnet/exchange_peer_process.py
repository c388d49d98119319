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
records are alive (``--record-ttl``, 60 s: longer than a loaded round) less those whose address
refuses a connection (``live_peers``: dead), and the first round starts once ``--peers`` of them
are there, so every peer forms the same groups. ``--result-dir`` saves each round's result as ``<node id>-<round>.pt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import time
from collections.abc import Collection

import torch

from murmur.node.exchange.group import DHTGroup, RendezvousSettings
from murmur.node.exchange.hierarchy import GroupedExchange
from murmur.node.exchange.peer import ExchangePeer, PeerSpec, build_peer
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.train.overrides import add_set_flag, config_from_args
from murmur.optim.codecs import make_codec
from murmur.protocol.dht import DHTError, DHTSettings, MurmurDHT, PeerRecord
from murmur.protocol.identity import Identity
from murmur.protocol.reachability import refuses_connections
from murmur.protocol.wire import tensors_hash


def update_for(node_id: str, round_id: int, numel: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{node_id}/{round_id}".encode()).digest()[:8], "little")
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def wait_for_records(
    dht: MurmurDHT, records: list[PeerRecord], peers: int, deadline_s: float, ttl: float
) -> dict[str, str]:
    """{node id: address} of the peers seen in the DHT, once ``peers`` of them were (or at the
    deadline): the groups of the first round are formed from them, and a peer that saw fewer
    would form other groups than the rest. Reads are added up: a busy DHT answers a read with
    part of the records (a different part each time), and 64 peers waited out the deadline for
    one read with all of them. Our records (``records``) are announced again every half TTL
    meanwhile: the first peers up must not expire while the last ones start."""
    end = announced = time.monotonic()
    end += deadline_s
    seen: dict[str, str] = {}
    while time.monotonic() < end:
        try:
            seen.update((r.node_id, r.address) for r in dht.peers())
        except DHTError:
            pass  # busy: read again at the next poll
        if len(seen) >= peers:
            break
        if time.monotonic() - announced > ttl / 2:
            for record in records:
                announce(dht, record)
            announced = time.monotonic()
        time.sleep(0.1)
    return seen


def live_peers(dht: MurmurDHT, mine: Collection[str] = (), before: dict[str, str] | None = None) -> dict[str, str]:
    """{node id: address} of the live peers a round's groups are formed from: those whose DHT
    records are alive, and those of the round before (``before``) whose records a busy DHT left
    out of this read (a read short of peers gave a host of 8 peers another M than the rest), less
    those whose address refuses a connection: dead (a SIGKILLed peer's record outlives it by its
    TTL; left in, its group would wait for it at the rendezvous). ``mine``: this process's own
    peers, alive by definition. Blocking: call it off the loop, as the DHT read is."""
    try:
        records = {r.node_id: r.address for r in dht.peers()}
    except DHTError as err:  # a DHT too busy to answer: the round before's view, checked again
        print(f"live peers: the DHT read failed ({err}); the round before's {len(before or {})} kept", file=sys.stderr)
        records = {}
    found = {**(before or {}), **records}
    return {n: a for n, a in sorted(found.items()) if n in mine or not refuses_connections(a)}


def announce(dht: MurmurDHT, record: PeerRecord) -> None:
    """A round's re-announcement, best effort: a store that a busy DHT failed is tried again next
    round (the record lives record_ttl, longer than a round), not a reason to end the peer."""
    try:
        dht.announce(record)
    except DHTError as err:
        print(f"{record.node_id}: could not re-announce ({err})", file=sys.stderr)


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
    # Longer than a loaded round: each peer forms a round's groups from the live records, and a
    # record that expired mid-round at some peers gives them another formation than the rest.
    ap.add_argument("--record-ttl", type=float, default=60.0)
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
            # The first round waits for --peers; later ones for the live peers as the round
            # found them (live_peers: alive records, dead addresses left out).
            return args.peers if first_round else len(live)

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
        seen: dict[str, str] = {}  # the live peers of the round before, with their addresses
        exchange = GroupedExchange(
            peer.exchange, run_id=args.run, live=lambda: live, group_size=group_size, addresses=lambda: seen
        )
        emit(event="ready", node_id=identity.node_id, address=address)
        if args.peers > group_size:
            seen = wait_for_records(dht, [record], args.peers, args.rendezvous_deadline, args.record_ttl)
        for r in range(1, args.rounds + 1):
            t0 = time.monotonic()
            announce(dht, record)  # re-announce every round: the record lives record_ttl seconds
            seen = live_peers(dht, {identity.node_id}, seen)
            live[:] = list(seen)
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
