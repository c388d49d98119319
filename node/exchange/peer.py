"""One exchange peer, built in one place: its TLS peer server, its `GrpcExchange`, its group.

Every caller that needs an exchange peer calls this module: the node's data plane
(node/daemon/peer_dataplane.py, on its own loop: ``await abuild_peer(...)``), the testnet's
exchange peer process (node/testnet/exchange_peer_process.py), the exchange benchmark and the
tests (from another thread, through a LoopThread: ``build_peer(...)``). The spec names what differs between them; the
wiring (the server started before the exchange exists, the address peers dial, the group that may
need that address, the exchange's handlers on the server) is the same for all.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from murmur.node.exchange.group import GroupProvider, RoundGate
from murmur.node.exchange.grpc_exchange import GrpcExchange, LoopHandle
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.server import PeerServer, PeerServerSettings
from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.protocol.identity import BanList, Identity
from murmur.protocol.reachability import CLIENT_ADDRESS, is_client


@dataclass(kw_only=True, slots=True)
class PeerSpec:
    identity: Identity
    run_id: str
    codec: Codec
    # The round's members: a provider, or a function (maybe async) of the address peers dial this
    # peer at (a DHT group announces it), called once the server is listening.
    group: GroupProvider | Callable[[str], GroupProvider | Awaitable[GroupProvider]]
    aggregator: Aggregator | None = None  # None: the plain mean
    settings: ExchangeSettings = field(default_factory=ExchangeSettings)
    server: PeerServerSettings = field(default_factory=PeerServerSettings)  # host, port (0: any)
    ban_list: BanList | None = None  # None: a ban list of its own, empty
    faults: FaultInjector | None = None  # None: no faults armed
    advertise_host: str = ""  # the host peers dial, when it is not the one the server listens on
    # Client mode (protocol/reachability.py): True, False, or a check of the address peers would
    # dial (the coordinator's dial-back) answering whether nobody can reach it. A client-mode peer
    # advertises CLIENT_ADDRESS: it owns no span and serves nothing to peers.
    client_mode: bool | Callable[[str], Awaitable[bool]] = False
    gate: RoundGate | None = None  # the run's arbiter of round groups (a node's coordinator session)


@dataclass(slots=True)
class ExchangePeer:
    server: PeerServer
    exchange: GrpcExchange

    @property
    def node_id(self) -> str:
        return self.server.node_id

    @property
    def address(self) -> str:
        """host:port as peers dial it (CLIENT_ADDRESS in client mode: nobody dials it)."""
        return self.server.address

    @property
    def client_mode(self) -> bool:
        return is_client(self.server.address)

    async def aclose(self) -> None:
        await self.exchange.aclose()
        await self.server.stop()


async def abuild_peer(spec: PeerSpec, loop: LoopHandle) -> ExchangePeer:
    """Start the peer server on ``spec.server``'s host and port, then build the exchange on it.
    Runs on the loop that ``loop`` hands the exchange's calls to."""
    server = PeerServer(spec.identity, run_id=spec.run_id, ban_list=spec.ban_list, settings=spec.server)
    bound = await server.start()
    if spec.advertise_host:
        server.address = f"{spec.advertise_host}:{bound.rpartition(':')[2]}"  # what the exchange tells peers
    try:
        client = spec.client_mode if isinstance(spec.client_mode, bool) else await spec.client_mode(server.address)
        if client:
            server.address = CLIENT_ADDRESS
        group = spec.group(server.address) if callable(spec.group) else spec.group
        if inspect.isawaitable(group):
            group = await group
        exchange = GrpcExchange(
            server,
            loop,
            group,
            spec.codec,
            aggregator=spec.aggregator,
            settings=spec.settings,
            faults=spec.faults,
            gate=spec.gate,
        )
    except BaseException:
        await server.stop()
        raise
    return ExchangePeer(server, exchange)


def build_peer(spec: PeerSpec, loop: LoopHandle) -> ExchangePeer:
    """`abuild_peer` from a thread other than the loop's (tests, the peer process, the benchmark)."""
    return loop.run(abuild_peer(spec, loop))
