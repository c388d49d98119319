"""The member's side of the coordinator protocol: join with a token, then heartbeat, lease, commit.

Shared by the node daemon, the tests and the load benchmark (the node may not import coordinator/,
so the client lives with the contract). Joining:

    identity, info = await join_run("coord:7700", token, key)
    client = MemberClient(info.node_address, identity, server_name=info.tls_server_name)
    lease = await client.acquire()
    ...
    await client.commit(lease.lease_id, lease.shard_id, start, end, outer_step=1, loss=2.3)

Every call carries the protocol version; every coordinator refusal becomes a ``CoordinatorError``
with the coordinator's one-line reason and the gRPC status code (``.code``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc

from murmur.errors import MurmurError

from . import coordinator_pb2 as pb
from . import coordinator_pb2_grpc as pb_grpc
from . import identity
from .heartbeat_udp_client import DatagramBeats
from .jointoken import JoinToken, fetch_pinned_ca
from .version import PROTOCOL_VERSION, version_metadata

CALL_TIMEOUT_S = 10.0  # one control-plane call; the coordinator answers in milliseconds when healthy


class CoordinatorError(MurmurError):
    def __init__(self, method: str, code: grpc.StatusCode | None, details: str) -> None:
        self.method, self.code, self.details = method, code, details
        if code == grpc.StatusCode.UNAVAILABLE:
            msg = f"cannot reach the coordinator ({details}); is it running at that address?"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            msg = f"the coordinator did not answer {method} in time; try again"
        else:
            msg = details or f"{method} failed with {code}"
        super().__init__(msg)


async def call(method: str, fn: Any, request: Any, metadata: tuple[tuple[str, str], ...], timeout_s: float) -> Any:
    try:
        return await fn(request, metadata=metadata, timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        raise CoordinatorError(method, err.code(), err.details() or "") from None


@dataclass(slots=True)
class JoinInfo:
    node_id: str
    run_id: str
    config_toml: str
    node_address: str
    tls_server_name: str
    bootstrap_peers: list[str]
    heartbeat_interval_s: float
    heartbeat_ttl_s: float
    lease_ttl_s: float
    heartbeat_address: str = ""  # the coordinator's heartbeat front for this node ("" none)
    heartbeat_udp_address: str = ""  # where heartbeats may go as signed datagrams ("" none)
    heartbeat_udp_key: bytes = b""  # this node's key for them

    @property
    def heartbeat_udp(self) -> tuple[str, bytes]:
        return self.heartbeat_udp_address, self.heartbeat_udp_key


async def join_run(
    address: str,
    token: str,
    key: identity.PrivateKey,
    *,
    hardware: pb.Hardware | None = None,
    peer_address: str = "",
    timeout_s: float = CALL_TIMEOUT_S,
    server_name: str = "murmur-coordinator",
    name: str = "",
) -> tuple[identity.Identity, JoinInfo]:
    """Join the run a token admits to; returns the node's identity (key + certificate + CA)."""
    parsed = JoinToken.parse(token)
    ca_pem = await asyncio.to_thread(fetch_pinned_ca, address, parsed.ca_fingerprint, timeout_s=timeout_s)
    creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    options = [("grpc.ssl_target_name_override", server_name)]
    async with grpc.aio.secure_channel(address, creds, options=options) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        request = pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION,
            token=token,
            csr_pem=identity.make_csr(key),
            hardware=hardware or pb.Hardware(device="cpu"),
            peer_address=peer_address,
            name=name,
        )
        reply = await call("Join", stub.Join, request, version_metadata(), timeout_s)
    if reply.ca_certificate_pem != ca_pem and identity.load_certificate(
        reply.ca_certificate_pem
    ) != identity.load_certificate(ca_pem):
        raise MurmurError("the coordinator's join reply names another CA than the one pinned; refusing it")
    ident = identity.Identity(key=key, cert_pem=bytes(reply.certificate_pem), ca_cert_pem=ca_pem)
    if ident.node_id != reply.node_id:
        raise MurmurError("the coordinator issued a certificate for another node id; refusing it")
    info = JoinInfo(
        node_id=reply.node_id,
        run_id=reply.run_id,
        config_toml=reply.config_toml,
        node_address=reply.node_address,
        tls_server_name=reply.tls_server_name or server_name,
        bootstrap_peers=list(reply.bootstrap_peers),
        heartbeat_interval_s=reply.heartbeat_interval_s,
        heartbeat_ttl_s=reply.heartbeat_ttl_s,
        lease_ttl_s=reply.lease_ttl_s,
        heartbeat_address=reply.heartbeat_address,
        heartbeat_udp_address=reply.heartbeat_udp_address,
        heartbeat_udp_key=bytes(reply.heartbeat_udp_key),
    )
    return ident, info


class MemberClient:
    """Calls of a joined node, over mutual TLS with its certificate."""

    def __init__(
        self,
        node_address: str,
        ident: identity.Identity,
        *,
        server_name: str = "murmur-coordinator",
        timeout_s: float = CALL_TIMEOUT_S,
        reconnect_backoff_s: float | None = None,
        heartbeat_address: str = "",
        heartbeat_udp: tuple[str, bytes] = ("", b""),
    ) -> None:
        """``reconnect_backoff_s``: the longest wait between attempts to reach a coordinator that
        went away (None: gRPC's own backoff, which grows to two minutes). A member that keeps
        working through an outage sets it, to see the coordinator's return soon after it.
        ``heartbeat_address``: the front its join reply named, so the first stream opens there.
        ``heartbeat_udp``: the datagram address and key its join reply offered (JoinInfo.heartbeat_udp),
        so the first heartbeats go as datagrams; else they start once a gRPC reply offers them."""
        self._creds = grpc.ssl_channel_credentials(
            root_certificates=ident.ca_cert_pem, private_key=ident.key_pem, certificate_chain=ident.cert_pem
        )
        # No bandwidth probes (BDP pings) on this channel: it carries small member calls only (a
        # state is fetched on a channel of its own), and every heartbeat reply set one off, a
        # ping and its ack at both ends (coordinator/serving.py: serving_options).
        options: list[tuple[str, str | int]] = [("grpc.ssl_target_name_override", server_name)]
        options.append(("grpc.http2.bdp_probe", 0))
        if reconnect_backoff_s is not None:
            backoff_ms = max(1, round(reconnect_backoff_s * 1000))
            options += [
                ("grpc.initial_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ]
        self._options = options
        self.channel = grpc.aio.secure_channel(node_address, self._creds, options=options)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = version_metadata()
        self.ban_list_version = -1
        # The live-trainer view as the replies built it up, and its version: sent back with each
        # heartbeat, so the coordinator lists only what changed since (coordinator/trainer_view.py).
        self.view_version = 0
        self.view_members: dict[str, pb.LiveMember] = {}
        # Heartbeats go on one long-lived stream (HeartbeatStream: a message on an open stream costs
        # the coordinator far less than a unary call); a coordinator without it answers
        # UNIMPLEMENTED once and this client uses the unary Heartbeat from then on. One heartbeat at
        # a time on the stream (the lock), so each reply is the answer to its own request.
        self.heartbeat_stream = True
        self._beats: Any = None
        self._beats_lock = asyncio.Lock()
        # A coordinator with heartbeat fronts names the one this node's stream goes to in its
        # replies (heartbeat_address; coordinator/fronts.py): the stream opens there, on a channel
        # of its own, and every other call stays on the node address. Any failure there sends the
        # next heartbeat to the node address again, whose reply names the front anew.
        self.heartbeat_address = heartbeat_address
        self._front: Any = None  # (channel, stub) to heartbeat_address, opened with its first stream
        # Heartbeats as signed datagrams while the coordinator offers them (every gRPC heartbeat
        # reply says whether it does, and with which key: protocol/heartbeat_udp_client.py); each
        # beat that gets no datagram answer goes over gRPC as above.
        self.datagrams = DatagramBeats(ident.node_id)
        self.datagrams.offer(*heartbeat_udp)
        self._datagram_lock = asyncio.Lock()

    async def close(self) -> None:
        self.datagrams.close()
        self._drop_stream()
        await self._close_front()
        await self.channel.close()

    async def _close_front(self) -> None:
        if self._front is not None:
            channel, self._front = self._front[0], None
            await channel.close()

    async def _follow(self, address: str) -> None:
        """Heartbeat at ``address`` from the next heartbeat on ("" the node address)."""
        if address != self.heartbeat_address:
            self._drop_stream()
            await self._close_front()
            self.heartbeat_address = address

    async def __aenter__(self) -> MemberClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any) -> Any:
        return await call(method, getattr(self.stub, method), request, self.metadata, self.timeout_s)

    async def heartbeat(
        self,
        tokens_per_s: float = 0.0,
        state: str = "",
        *,
        peer: pb.HeartbeatRequest | None = None,
        starting: bool = False,
    ) -> pb.HeartbeatReply:
        """``peer``: the node's data-plane fields (incarnation, peer_address, round, state_hash);
        ``starting``: the process opens its data plane next (the coordinator's join grace)."""
        request = pb.HeartbeatRequest(
            tokens_per_s=tokens_per_s, ban_list_version=self.ban_list_version, state=state, starting=starting
        )
        if peer is not None:
            request.MergeFrom(peer)
            request.view_version = self.view_version
        if starting:
            # The process forks its DHT next, and a fork must never happen under a live gRPC call
            # (the child aborts: node/daemon/node.py); a stream is a live call for as long as it is
            # open, so this one heartbeat is unary and leaves none open. The stream opens with the
            # heartbeats that follow, once the DHT's process runs.
            self._drop_stream()
            reply = await self._call("Heartbeat", request)
            self.datagrams.offer(reply.heartbeat_udp_address, bytes(reply.heartbeat_udp_key))
        else:
            reply = await self._beat(request)
        if reply.ban_list_changed:
            self.ban_list_version = reply.ban_list.version
        self.take_view(reply)
        await self._follow(reply.heartbeat_address)
        return reply

    async def _beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """One heartbeat: on the stream (opened now if none is open), else unary. Every failure is a
        CoordinatorError as a unary call's would be, and drops the stream: the next heartbeat opens
        a fresh one (a reply still in flight on the old one is never taken for its answer). First,
        while offered, as a datagram: its reply is taken only whole and signed, else gRPC answers."""
        if self.datagrams.usable() and not self._datagram_lock.locked():
            async with self._datagram_lock:
                reply = await self.datagrams.beat(request)
            if reply is not None:
                return reply
        reply = await self._grpc_beat(request)
        self.datagrams.offer(reply.heartbeat_udp_address, bytes(reply.heartbeat_udp_key))  # or "none now"
        return reply

    async def _grpc_beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        if not self.heartbeat_stream:
            return await self._call("Heartbeat", request)
        async with self._beats_lock:
            try:
                return await asyncio.wait_for(self._round_trip(request), self.timeout_s)
            except TimeoutError:
                await self._stream_failed()
                raise CoordinatorError("Heartbeat", grpc.StatusCode.DEADLINE_EXCEEDED, "") from None
            except grpc.aio.AioRpcError as err:
                await self._stream_failed()
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise CoordinatorError("Heartbeat", err.code(), err.details() or "") from None
            except BaseException:  # cancelled mid-way (a caller's wait_for): the pairing is unknown
                self._drop_stream()
                raise
        self.heartbeat_stream = False  # an older coordinator: unary from now on
        return await self._call("Heartbeat", request)

    async def _stream_failed(self) -> None:
        """The stream failed: the next heartbeat opens a fresh one, at the node address (a front
        that is gone is named again, or another, by the reply there)."""
        self._drop_stream()
        await self._follow("")

    async def _round_trip(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        if self._beats is None:
            stub = self.stub
            if self.heartbeat_address:  # a front of the coordinator's (opened lazily: never before a fork)
                if self._front is None:
                    channel = grpc.aio.secure_channel(self.heartbeat_address, self._creds, options=self._options)
                    self._front = (channel, pb_grpc.CoordinatorStub(channel))
                stub = self._front[1]
            self._beats = stub.HeartbeatStream(metadata=self.metadata)
        beats = self._beats
        try:
            await beats.write(request)
            reply = await beats.read()
        except asyncio.InvalidStateError:  # the stream had ended (the coordinator refused or went away)
            reply = grpc.aio.EOF
        if reply is grpc.aio.EOF:  # ended: its status says why (an OK end is the coordinator stopping)
            code = await beats.code()
            details = await beats.details()
            if code == grpc.StatusCode.OK:
                code, details = grpc.StatusCode.UNAVAILABLE, "the coordinator ended the heartbeat stream"
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        return reply

    def _drop_stream(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            self._beats = None

    def take_view(self, reply: pb.HeartbeatReply) -> None:
        """Bring the view this client holds to the reply's version (whole, or the changes applied)."""
        if reply.view_whole and not reply.view_unchanged:
            if not reply.view_delta:
                self.view_members = {}
            for node_id in reply.view_removed:
                self.view_members.pop(node_id, None)
            self.view_members.update((m.node_id, m) for m in reply.members)
            self.view_version = reply.view_version

    def members(self, reply: pb.HeartbeatReply) -> list[pb.LiveMember]:
        """The live trainers a heartbeat reply stands for (by node id): its list when it is whole,
        else the view this client built from the replies (unchanged, or the changes applied)."""
        if not reply.view_unchanged and not reply.view_delta:
            return list(reply.members)
        return [self.view_members[n] for n in sorted(self.view_members)]

    async def acquire(self, exhausted: list[str] | tuple[str, ...] = ()) -> pb.AcquireLeaseReply:
        """A lease: the one this node holds, else a free shard. ``exhausted``: held leases with no
        full batch left (committed with the window under way): a free shard, they stay held."""
        return await self._call("AcquireLease", pb.AcquireLeaseRequest(exhausted=list(exhausted)))

    async def commit(
        self,
        lease_id: str,
        shard_id: int,
        start_offset: int,
        end_offset: int,
        *,
        outer_step: int = 0,
        loss: float = 0.0,
        bytes_sent: int = 0,
        seconds: float = 0.0,
        round_members: list[str] | tuple[str, ...] = (),
        val_loss: float | None = None,
    ) -> pb.CommitReply:
        return await self._call(
            "Commit",
            pb.CommitRequest(
                lease_id=lease_id,
                shard_id=shard_id,
                start_offset=start_offset,
                end_offset=end_offset,
                outer_step=outer_step,
                loss=loss,
                bytes_sent=bytes_sent,
                seconds=seconds,
                round_members=list(round_members),
                val_loss=val_loss,  # None leaves the optional field unset
            ),
        )

    async def release(self, lease_id: str) -> pb.ReleaseLeaseReply:
        return await self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

    async def bootstrap_peers(self) -> list[str]:
        """The DHT multiaddrs the coordinator hands out now (empty: it runs no DHT)."""
        reply = await self._call("GetBootstrapPeers", pb.GetBootstrapPeersRequest())
        return list(reply.multiaddrs)

    async def stages(self) -> pb.StageMap:
        """The run's stage peers as the coordinator sees them (a pipelined run)."""
        return await self._call("GetStages", pb.GetStagesRequest())

    async def check_reachable(self, peer_address: str) -> tuple[bool, str]:
        """(reachable, why not): the coordinator dials ``peer_address`` back."""
        reply = await self._call("CheckReachable", pb.CheckReachableRequest(peer_address=peer_address))
        return bool(reply.reachable), reply.reason

    async def claim_round(
        self, round_id: int, key: str, members: list[str] | tuple[str, ...], run_round: int = 0
    ) -> bool:
        """May this node apply its group's result of exchange call (round, key)? True granted,
        False undecided (the coordinator just restarted); a refusal (a split) is a
        CoordinatorError with code ABORTED and the reason. ``run_round``: the run round this
        node's window completes with the result (a grant makes it the run's newest)."""
        request = pb.ClaimRoundRequest(round=round_id, key=key, members=list(members), run_round=run_round)
        reply = await self._call("ClaimRound", request)
        return bool(reply.decided)

    async def claim_lost_rounds(self, round_id: int, from_round: int = 0) -> pb.ClaimRoundReply:
        """May this node go on from its own state (of round ``from_round``) numbered as
        ``round_id``, the holders of the run's rounds past its state being gone? Returns the grant
        (``from_scratch``: the operator said to go on from a fresh model); a refusal (another live
        node was granted that number, the coordinator keeps a newer state, or the run waits for its
        operator) is a CoordinatorError with code ABORTED and the reason."""
        return await self._call(
            "ClaimRound", pb.ClaimRoundRequest(round=round_id, lost_rounds=True, from_round=max(0, from_round))
        )

    async def report_gone(self, peers: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> pb.ReportGoneReply:
        """Report (node id, peer address) of peers whose address refused a connect: the coordinator
        verifies each with a connect of its own and marks the dead ones lost. The reply names
        those it holds lost and carries its view after that (as a heartbeat reply's)."""
        items = [pb.GonePeer(node_id=n, peer_address=a) for n, a in peers]
        return await self._call("ReportGone", pb.ReportGoneRequest(peers=items))

    async def report_rejections(self, rejected: list[tuple[int, str, str]]) -> int:
        """Report (round, sender, reason) of updates this node refused; how many were counted."""
        items = [pb.RejectedUpdate(sender_node_id=s, round=r, reason=why[:200]) for r, s, why in rejected]
        reply = await self._call("ReportRejections", pb.ReportRejectionsRequest(rejected=items))
        return int(reply.recorded)

    async def report_checkpoint(self, step: int, location: str, sha256: str) -> None:
        await self._call("ReportCheckpoint", pb.ReportCheckpointRequest(step=step, location=location, sha256=sha256))

    async def ban_list(self) -> pb.BanList:
        return await self._call("GetBanList", pb.GetBanListRequest())

    async def leave(self, reason: str = "") -> pb.LeaveReply:
        return await self._call("Leave", pb.LeaveRequest(reason=reason))
