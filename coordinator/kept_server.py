"""The coordinator serves its kept states over the peer protocol's GetState, at its node address.

A node restoring a run that no live trainer serves fetches the kept state with its ordinary fetch
(node/net/state_transfer.py), as from a peer: mutual TLS with its run certificate, the manifest,
the parts, the whole checked against the hash. Only GetState is served, only for ``kept/...``
names (coordinator/keeper.py), only to an unbanned certificate of the run's CA (a member, or a
reader that `murmur export --coordinator` holds); Hello and Exchange are not the coordinator's.
"""

from __future__ import annotations

import grpc

from murmur.protocol import malformed, peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BanList, IdentityError
from murmur.protocol.state_client import state_frames

from .keeper import StateKeeper
from .membership import Membership


class KeptStateServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, keeper: StateKeeper, membership: Membership) -> None:
        self.keeper, self.membership = keeper, membership

    async def Hello(self, request: peer_pb2.HelloRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the coordinator serves only GetState of its kept states")

    async def Exchange(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802, ANN001
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the coordinator takes part in no exchange")
        yield peer_pb2.ExchangeReply()  # never reached: makes this a stream handler

    async def GetState(self, request: peer_pb2.StateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            tls.authenticated_peer(context.auth_context(), BanList(self.membership.banned()))
        except IdentityError as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{err}; fetch kept states at the node address")
        state = self.keeper.served(request.name)
        if state is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"the coordinator keeps no state {request.name!r}")
        for frame in state_frames(state, list(request.tensors)[:100_000]):
            await context.write(frame)


def register(server: grpc.aio.Server, keeper: StateKeeper, membership: Membership) -> None:
    # Through the guard: a request that does not parse is refused in one line, as on every server.
    malformed.register(peer_pb2_grpc.add_PeerServicer_to_server, KeptStateServicer(keeper, membership), server)
