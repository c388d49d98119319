"""The node's peer-to-peer data plane, assembled from the protocol parts.

* the peer gRPC server (node/net/server.py: mutual TLS, version and ban checks, state serving),
* the DHT (protocol/dht.py): this node's signed record (address, last round, state hash),
  re-announced before it expires and withdrawn on leave; the round rendezvous,
* the gRPC exchange (node/exchange/grpc_exchange.py) with the run's codec and aggregator, its members
  found by DHT rendezvous,
* state transfer (node/net/state_transfer.py): the newest global state, fetched from several peers in
  parallel and checked against the hash their records announce.

Everything runs on the daemon's one asyncio loop (the exchange gets a handle on it); the DHT's
blocking calls run in worker threads. The DHT process and its p2pd are children of this process:
`close()` stops them, and protocol/dht.py's reaper kills them should this process die first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from murmur.node.daemon.dataplane import _MemberTracker
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import JoinInfo
from murmur.node.exchange.group import DHTGroup, RendezvousSettings
from murmur.node.exchange.grpc_exchange import ExchangeSettings, GrpcExchange
from murmur.node.net.server import PeerServer, PeerServerSettings, PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch, state_name
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.protocol import identity
from murmur.protocol.dht import DHTError, DHTSettings, MurmurDHT, PeerRecord
from murmur.protocol.runconfig import RunConfig
from murmur.protocol.wire import tensors_hash

# Peers of a round are trainers; the coordinator also announces itself under the run (role
# "coordinator") as a bootstrap peer, and must not be counted as a member or asked for state.
TRAINER = "trainer"

T = TypeVar("T")
WILDCARDS = ("0.0.0.0", "::", "[::]", "")
STATE_POLL_S = 0.5  # how often a joiner looks for peers' records
DHT_RETRY_S = 1.0  # pause between DHT start attempts
DHT_GOODBYE_TIMEOUT_S = 5.0  # the "gone" record; past this, peers learn of the exit from the TTL


class _LoopHandle:
    """What the exchange needs of a loop thread (`submit`, `run`), over the daemon's own loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)


def advertised(host: str, advertise_host: str) -> str:
    """The host peers dial: --advertise-host, else the listen host, else this machine's address."""
    if advertise_host:
        return advertise_host
    if host not in WILDCARDS:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PeerDataPlane:
    def __init__(
        self,
        ident: identity.Identity,
        info: JoinInfo,
        cfg: RunConfig,
        settings: NodeSettings,
        log: Callable[[str], None],
    ) -> None:
        self.ident, self.info, self.cfg, self.s, self.log = ident, info, cfg, settings, log
        self.server: PeerServer | None = None
        self.dht: MurmurDHT | None = None
        self.grpc: GrpcExchange | None = None
        self.exchange: _MemberTracker | None = None
        self.address = ""
        self.live_peers = 1
        self.record: PeerRecord | None = None
        self._announcer: asyncio.Task | None = None
        self._stop = asyncio.Event()

    async def start(self, listen: str, advertise_host: str, dht_peers: list[str], state_dir: Path) -> None:
        host, _, port = listen.rpartition(":")
        self.server = PeerServer(
            self.ident,
            run_id=self.info.run_id,
            settings=PeerServerSettings(host=host or "127.0.0.1", port=int(port or 0)),
        )
        bound = await self.server.start()
        self.address = f"{advertised(host, advertise_host)}:{bound.rpartition(':')[2]}"
        self.server.address = self.address  # what the exchange tells its peers
        initial = list(self.info.bootstrap_peers) + list(dht_peers)
        self.dht = MurmurDHT(
            self.info.run_id,
            ca_cert_pem=self.ident.ca_cert_pem,
            identity=self.ident,
            initial_peers=initial,
            settings=DHTSettings(
                host=host if host not in WILDCARDS else "0.0.0.0",
                record_ttl=self.s.dht_record_ttl_s,
                start_timeout=self.s.dht_start_timeout_s,
            ),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.s.dht_start_timeout_s
        while True:
            try:
                await asyncio.to_thread(self.dht.start)
                break
            except DHTError as err:
                # A bootstrap peer that is slow to answer (a loaded machine, a restarting peer)
                # fails p2pd's start: try again until the start timeout.
                if loop.time() >= deadline:
                    self.dht = None
                    raise
                self.log(f"DHT start failed ({err}); retrying")
                await asyncio.sleep(DHT_RETRY_S)
        # Where others can bootstrap from and dial us (read by `murmur testnet` and by operators).
        (state_dir / "peer.json").write_text(
            json.dumps({"node_id": self.ident.node_id, "address": self.address, "dht": self.dht.addresses})
            + "\n"
        )
        if not initial:
            self.log(
                "no DHT bootstrap peers (the coordinator runs no DHT and none was given): "
                "this node starts the run's DHT; others can join it with --dht-peer"
            )
        group = DHTGroup(
            self.dht,
            self.address,
            expected=lambda: self.live_peers,
            settings=RendezvousSettings(deadline=self.s.rendezvous_deadline_s),
        )
        self.grpc = GrpcExchange(
            self.server,
            _LoopHandle(asyncio.get_running_loop()),
            group,
            make_codec_for(self.cfg.sync),
            aggregator=make_aggregator_for(self.cfg.sync),
            settings=ExchangeSettings(
                peer_timeout=self.s.peer_timeout_s,
                round_deadline=self.s.round_timeout_s,
                chunk_mb=self.cfg.sync.exchange_chunk_mb,
            ),
        )
        self.exchange = _MemberTracker(self.grpc)
        self.log(f"peer server on {self.address}; DHT on {', '.join(self.dht.addresses[:1]) or '?'}")

    # -- discovery -------------------------------------------------------------------------------

    async def _announce(self) -> None:
        if self.record is None or self.dht is None:
            return
        try:
            stored = await self.dht.aannounce(self.record)
            peers = await self.dht.apeers(role=TRAINER)
            self.live_peers = max(1, len(peers))
            if not stored and len(peers) > 1:
                self.log("DHT announce was not stored; retrying")
        except DHTError as err:
            self.log(f"DHT announce failed ({err}); retrying")

    async def _announce_loop(self) -> None:
        period = self.s.dht_record_ttl_s / 3  # re-announce well before the record expires
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), period)
            await self._announce()

    async def wait_for_peers(
        self, count: int, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> int:
        """Wait until ``count`` peers (this one included) are in the DHT, the timeout, or a stop.
        Peers that are still starting have no record yet: they are found by rendezvous entries
        too, so this also counts nodes that registered for round 0."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        assert self.server is not None
        # Until the first round, announce round -1 so others can count this node.
        self.record = PeerRecord(node_id=self.ident.node_id, address=self.address, round=-1)
        while self.dht is not None:
            # Re-announce each time: a lone first node's store fails until someone joins its DHT.
            await self._announce()
            peers = await self.dht.apeers(role=TRAINER)
            self.live_peers = max(1, len(peers))
            if len(peers) >= count or loop.time() >= deadline or stop():
                return len(peers)
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
        return 0

    # -- state -----------------------------------------------------------------------------------

    def publish(self, round_id: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Serve this round's global state to joiners and announce (round, hash) in the DHT."""
        assert self.server is not None
        digest = tensors_hash(tensors)
        members = list(self.exchange.members) if self.exchange else []
        self.server.publish_state(PublishedState(state_name(round_id), tensors, digest, members))
        self.record = PeerRecord(
            node_id=self.ident.node_id, address=self.address, round=round_id, state_hash=digest.hex()
        )
        if self._announcer is None:
            self._announcer = asyncio.create_task(self._announce_loop())
        asyncio.create_task(self._announce())

    async def fetch_state(self, *, min_round: int, timeout_s: float) -> dict[str, torch.Tensor] | None:
        """The newest global state some peers announce, if its round is at least ``min_round``."""
        if self.dht is None:
            return None
        # Right after joining the DHT a lookup may not see anyone yet: look again until some peer
        # shows up or the rendezvous deadline says this node is the first one.
        loop = asyncio.get_running_loop()
        alone_after = loop.time() + self.s.rendezvous_deadline_s
        while True:
            try:
                records = [r for r in await self.dht.apeers(role=TRAINER) if r.node_id != self.ident.node_id]
            except DHTError as err:
                self.log(f"cannot list peers ({err}); starting from the local state")
                return None
            if records or loop.time() >= alone_after:
                break
            await asyncio.sleep(STATE_POLL_S)
        deadline = loop.time() + timeout_s
        while True:
            others = [r for r in records if r.round >= min_round and r.state_hash]
            if not others:
                return None
            # The newest round; within it, the hash most peers hold (a lone liar is outvoted).
            newest = max(r.round for r in others)
            votes = Counter(r.state_hash for r in others if r.round == newest)
            digest = votes.most_common(1)[0][0]
            holders = {r.node_id: r.address for r in others if r.round == newest and r.state_hash == digest}
            try:
                tensors, _ = await asyncio.wait_for(
                    afetch(self.ident, holders, state_name(newest), bytes.fromhex(digest),
                           settings=StateFetchSettings(call_timeout=timeout_s)),
                    max(1.0, deadline - loop.time()),
                )
            except (TimeoutError, StateError) as err:
                # Peers move on and drop old states: look again while time is left, rather than
                # train alone from a stale state.
                self.log(f"could not fetch the state of round {newest} from {len(holders)} peers: {err}")
                if loop.time() >= deadline:
                    return None
                await asyncio.sleep(STATE_POLL_S)
                try:
                    records = [r for r in await self.dht.apeers(role=TRAINER) if r.node_id != self.ident.node_id]
                except DHTError:
                    return None
                continue
            self.log(f"fetched the state of round {newest} from {len(holders)} peer(s), "
                     f"hash {digest[:12]} verified")
            return tensors

    def last_round_members(self) -> list[str]:
        return self.exchange.members if self.exchange else []

    # -- leaving ---------------------------------------------------------------------------------

    async def close(self) -> None:
        """Say goodbye in the DHT, stop serving, stop the DHT process (and p2pd)."""
        self._stop.set()
        if self._announcer is not None:
            self._announcer.cancel()
            await asyncio.gather(self._announcer, return_exceptions=True)
        if self.dht is not None and self.record is not None:
            with contextlib.suppress(DHTError, Exception):
                await asyncio.wait_for(asyncio.to_thread(self.dht.withdraw), DHT_GOODBYE_TIMEOUT_S)
        if self.grpc is not None:
            with contextlib.suppress(Exception):
                await self.grpc.aclose()
        if self.server is not None:
            await self.server.stop()
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
            self.dht = None


async def open_peer_dataplane(
    *,
    ident: identity.Identity,
    info: JoinInfo,
    cfg: RunConfig,
    settings: NodeSettings,
    listen: str,
    advertise_host: str,
    log: Callable[[str], None],
    dht_peers: list[str],
    state_dir: Path,
) -> PeerDataPlane:
    plane = PeerDataPlane(ident, info, cfg, settings, log)
    try:
        await plane.start(listen, advertise_host, dht_peers, state_dir)
    except BaseException:
        await plane.close()
        raise
    return plane
