"""The node's peer gRPC server: mutual TLS, version and ban checks, health, state transfer, and the
door through which the exchange's streams arrive.

Every handler starts with ``_admit``: the protocol version in the call's metadata must be ours
(else FAILED_PRECONDITION naming both versions), and the caller's TLS certificate (already
verified against the run's CA by the handshake) must name a node that is not banned (else
PERMISSION_DENIED with the reason). Why a per-handler check rather than an interceptor:
protocol/tls.py. Only then is a byte of the request read.

``publish_state`` makes named tensors available to GetState (a round's result for peers that
missed it, the global state for joiners); node/net/state_transfer.py fetches them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from murmur.node.net.state_transfer import NEWEST_STATE, state_round
from murmur.protocol import malformed, peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BanList, BannedError, Identity, IdentityError
from murmur.protocol.version import PROTOCOL_VERSION, VERSION_METADATA_KEY, VersionMismatch, check_version
from murmur.protocol.wire import dtype_name, split, tensor_bytes

log = logging.getLogger(__name__)

STREAM_WINDOW_OPTION = "grpc.http2.lookahead_bytes"


@dataclass(kw_only=True, slots=True)
class PeerServerSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the real one is in ``address``
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES  # one gRPC message (a frame)
    chunk_bytes: int = 1 << 20  # frame size for streamed state
    max_published_states: int = 8  # oldest published states are dropped beyond this
    stop_grace: float = 1.0  # seconds in-flight calls get on stop()
    # HTTP/2 receive window per stream (gRPC's lookahead): what a sender may have in flight to us.
    # It must cover the link's rate x round trip, queueing included, or the stream waits for window
    # updates (64 KiB, gRPC's default, held a 100 Mbit/s shaped link at ~83%; 16 MiB at ~92%).
    stream_window_bytes: int = 16 << 20


@dataclass(slots=True)
class PublishedState:
    name: str
    tensors: list[tuple[str, torch.Tensor]]
    state_hash: bytes
    members: list[str] = field(default_factory=list)


# (peer id, context) -> None; the exchange's handler for one Exchange stream
ExchangeHandler = Callable[[str, grpc.aio.ServicerContext], Awaitable[None]]


async def start_mtls_server(
    add_servicer: Callable[[object, grpc.aio.Server], None],
    servicer: object,
    ident: Identity,
    host: str,
    port: int,
    options: list[tuple[str, int]],
    what: str,
) -> tuple[grpc.aio.Server, str]:
    """Start a gRPC server that requires a certificate of the run's CA, serving ``servicer`` through
    ``add_servicer`` (a generated ``add_*Servicer_to_server``); (server, "host:port")."""
    server = grpc.aio.server(options=options)
    malformed.register(add_servicer, servicer, server)  # a request that does not parse: one line
    try:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials(ident))
    except RuntimeError:  # gRPC's "Failed to bind": without SO_REUSEPORT, a port another process holds
        bound = 0
    if bound == 0:
        raise IdentityError(f"could not bind {what} to {host}:{port}: is the port taken?")
    await server.start()
    return server, f"{host}:{bound}"


class PeerServer(peer_pb2_grpc.PeerServicer):
    def __init__(
        self,
        identity: Identity,
        *,
        run_id: str,
        ban_list: BanList | None = None,
        settings: PeerServerSettings | None = None,
    ) -> None:
        self.identity = identity
        self.run_id = run_id
        self.ban_list = ban_list if ban_list is not None else BanList()
        self.settings = settings or PeerServerSettings()
        self.states: OrderedDict[str, PublishedState] = OrderedDict()
        self.exchange_handler: ExchangeHandler | None = None
        self.hello_rounds: Callable[[], Sequence[peer_pb2.RoundDone]] = lambda: ()
        self.refusals: list[tuple[str, str]] = []  # (who, reason): every call refused at the door
        self.on_refusal: Callable[[str, str], None] | None = None
        self._server: grpc.aio.Server | None = None
        self._calls: set[asyncio.Task] = set()  # handlers running now, each its call's task
        self._stopping = False
        self.address = ""

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    async def start(self) -> str:
        s = self.settings
        self._stopping = False
        options = [*tls.server_options(s.max_message_bytes), (STREAM_WINDOW_OPTION, s.stream_window_bytes)]
        self._server, self.address = await start_mtls_server(
            peer_pb2_grpc.add_PeerServicer_to_server, self, self.identity, s.host, s.port, options, "the peer server",
        )
        return self.address

    async def stop(self) -> None:
        """Give in-flight calls ``stop_grace`` seconds, then end the rest ourselves before gRPC stops.

        gRPC's own shutdown cancelling a handler in the middle of reading its request stream
        crashed the process (SIGSEGV in grpc.aio's Server.stop, grpc 1.85: 1 in 7 runs of
        test_a_peer_killed_mid_stream_leaves_the_survivors_with_one_state under load), so the
        handlers are cancelled as asyncio tasks first, and gRPC only stops a server with no call
        left in our code."""
        if self._server is None:
            return
        server, self._stopping = self._server, True
        grace = self.settings.stop_grace
        if grace and self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        while calls := [t for t in self._calls if not t.done()]:
            for t in calls:
                t.cancel()
            await asyncio.wait(calls, timeout=1.0)
            self._calls.difference_update(calls)
        await server.stop(None)
        self._server = None

    # -- the door --------------------------------------------------------------------------------

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's node id, or abort the call (banned, no certificate, other version)."""
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node is stopping")
        task = asyncio.current_task()  # the call's own task: stop() ends it (see there)
        if task is not None:
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        try:
            peer_id = tls.authenticated_peer(context.auth_context(), self.ban_list)
        except BannedError as err:
            await self._refuse(
                context, node_id_from_auth(context), grpc.StatusCode.PERMISSION_DENIED, str(err)
            )
        except IdentityError as err:
            await self._refuse(context, "", grpc.StatusCode.UNAUTHENTICATED, str(err))
        metadata = dict(context.invocation_metadata() or ())
        try:
            check_version(metadata.get(VERSION_METADATA_KEY), who="caller")
        except VersionMismatch as err:
            await self._refuse(context, peer_id, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return peer_id

    async def _refuse(self, context: grpc.aio.ServicerContext, peer_id: str, code: grpc.StatusCode, why: str):
        self.refusals.append((peer_id or "?", why))
        if peer_id and self.on_refusal is not None:
            self.on_refusal(peer_id, why)  # the exchange drops the peer from open attempts at once
        await context.abort(code, why)

    async def _reply_metadata(self, context: grpc.aio.ServicerContext) -> None:
        await context.send_initial_metadata(((VERSION_METADATA_KEY, str(PROTOCOL_VERSION)),))

    # -- handlers --------------------------------------------------------------------------------

    async def Hello(self, request: peer_pb2.HelloRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await self._admit(context)
        if request.run_id and request.run_id != self.run_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run mismatch: this node is in run {self.run_id!r}, the caller in {request.run_id!r}",
            )
        return peer_pb2.HelloReply(
            protocol_version=PROTOCOL_VERSION,
            run_id=self.run_id,
            node_id=self.node_id,
            done=list(self.hello_rounds()),
            states=list(self.states),
        )

    async def Exchange(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        peer_id = await self._admit(context)
        if self.exchange_handler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node takes part in no exchange yet")
        await self._reply_metadata(context)
        await self.exchange_handler(peer_id, context)

    async def GetState(self, request: peer_pb2.StateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await self._admit(context)
        state = self.states.get(request.name) if request.name != NEWEST_STATE else self._newest_state()
        if state is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no published state {request.name!r} on {self.node_id}"
            )
        # A state read from live tensors or a file (a stage peer's, node/pipeline/stage_state.py and
        # replica.py) is opened for the call and read frame by frame off the loop; a plain one is
        # its tensors.
        if getattr(state, "open", None) is not None:
            try:
                reader = state.open()
            except Exception as err:  # noqa: BLE001 - changed since, or gone: the caller asks again
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            try:
                await self._send_state(state, request, context, reader)
            finally:
                reader.close()
            return
        await self._send_state(state, request, context, None)

    async def _send_state(self, state, request: peer_pb2.StateRequest, context: grpc.aio.ServicerContext,
                          reader) -> None:
        infos = [
            peer_pb2.TensorInfo(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape))
            for n, t in state.tensors
        ]
        manifest = peer_pb2.StateManifest(
            name=state.name, state_hash=state.state_hash, tensors=infos, members=state.members
        )
        await context.write(peer_pb2.StateFrame(manifest=manifest))
        wanted = set(request.tensors)
        chunk = self.settings.chunk_bytes
        for name, t in state.tensors:
            if name not in wanted:
                continue
            if reader is None:
                pieces = split(tensor_bytes(t), chunk)
            else:  # one frame in memory at a time
                pieces = [(s, min(s + chunk, t.numel() * t.element_size()))
                          for s in range(0, max(1, t.numel() * t.element_size()), chunk)]
            for piece in pieces:
                if reader is not None:
                    try:
                        piece = await asyncio.to_thread(reader.read, name, *piece)
                    except Exception as err:  # noqa: BLE001 - the weights changed and nobody kept a copy
                        await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
                part = peer_pb2.StateFrame(part={"name": name, "dtype": dtype_name(t.dtype), "data": piece})
                await context.write(part)
            await asyncio.sleep(0)  # let other calls run between tensors

    # -- what GetState serves --------------------------------------------------------------------

    def publish_state(self, state: PublishedState) -> None:
        self.states[state.name] = state
        self.states.move_to_end(state.name)
        while len(self.states) > self.settings.max_published_states:
            self.states.popitem(last=False)

    def unpublish_state(self, name: str) -> None:
        self.states.pop(name, None)

    def _newest_state(self) -> PublishedState | None:
        """The newest ``state/<r>`` published (what NEWEST_STATE asks for)."""
        rounds = [(r, s) for s in self.states.values() if (r := state_round(s.name)) is not None]
        return max(rounds, key=lambda rs: rs[0])[1] if rounds else None


def node_id_from_auth(context: grpc.aio.ServicerContext) -> str:
    try:
        return tls.authenticated_peer(context.auth_context(), None)
    except IdentityError:
        return ""
