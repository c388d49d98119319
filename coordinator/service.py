"""The gRPC handlers: authenticate, translate protobuf <-> the ledger's calls, map errors to statuses.

Kept thin on purpose: the rules live in membership.py, leases.py, runs.py and gone.py.

Everything runs on the one asyncio loop, ledger calls included: each is one short SQLite
transaction (well under a millisecond plus an fsync), and a second thread would only add GIL
hand-offs (measured: a ledger thread made heartbeat latency worse under load, not better). The
hottest call, a heartbeat, touches only memory (membership.py). Blocking network calls do not
run on it: ReportGone's verifying connects go to worker threads (gone.py), CheckReachable's is
asyncio's own.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from murmur.errors import MurmurError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import coordinator_pb2_grpc as pb_grpc
from murmur.protocol.reachability import dial_back
from murmur.protocol.version import VERSION_METADATA_KEY, VersionMismatch, check_version

from .fronts import HeartbeatFronts
from .gone import MAX_GONE_PER_REPORT, GoneReports
from .group_commit import GroupCommit
from .heartbeat_udp import HeartbeatDatagrams
from .keeper import StateKeeper, kept_name
from .leases import Progress
from .membership import Membership, NoStateYet
from .preserialized import BeatReply
from .recovery import Recovery
from .runs import NotFound, RunError, Runs
from .serving import end_streams
from .settings import ADMIN_METADATA_KEY, TLS_SERVER_NAME, CoordinatorSettings
from .stage_board import StageBoard
from .status_report import StatusSource
from .store import Store
from .trainer_view import TrainerViews
from .trainers import SplitRound

T = TypeVar("T")
MAX_REJECTIONS_PER_REPORT = 1000  # what one ReportRejections may carry (the node batches below it)
MAX_MEASURED = 1000  # peer rates one driver heartbeat may carry (a run has far fewer stage peers)


class Stats:
    """Per-method call counts and errors, for the metrics endpoint."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def count(self, method: str, ok: bool) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if not ok:
            self.errors[method] = self.errors.get(method, 0) + 1


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        store: Store,
        settings: CoordinatorSettings,
        membership: Membership,
        runs: Runs,
        admin_key: str,
        ca_cert_pem: bytes,
        stage_board: StageBoard,
    ) -> None:
        self.store = store
        self.stage_board = stage_board
        self.settings = settings
        self.membership = membership
        self.leases = membership.leases
        self.runs = runs
        self.admin_key = admin_key
        self.ca_cert_pem = ca_cert_pem
        self.node_address = ""  # set by the server once bound
        self.bootstrap_peers: list[str] = []
        self.stats = Stats()
        self.status = StatusSource(store, membership, runs, settings)
        # The live-trainer view, built once per change and versioned (coordinator/trainer_view.py);
        # a trainer's new round reaches the others' replies within a heartbeat interval.
        self.views = TrainerViews(membership.trainers, membership.live_trainers, settings.heartbeat_interval_s,
                                  clock=membership.clock)
        self.gone = GoneReports(membership, settings.gone_dial_every_s)
        self.group = GroupCommit(store)  # commits that arrive together share one transaction (one fsync)
        self._streams: set[grpc.aio.ServicerContext] = set()  # the open heartbeat streams
        self.fronts: HeartbeatFronts | None = None  # heartbeat front processes, if any (set by the server)
        self.datagrams: HeartbeatDatagrams | None = None  # heartbeats over UDP, if on (set by the server)
        # The run's kept states and the operator's recovery decisions (coordinator/keeper.py,
        # coordinator/recovery.py); set by the server. started_at: heartbeat replies carry it,
        # so nodes see a restart (and dial its DHT peer again) even through no failed call.
        self.keeper: StateKeeper | None = None
        self.recovery: Recovery | None = None
        self.started_at = time.time()
        self.status.annotate = self._durability_into

    # --- plumbing ------------------------------------------------------------------------------

    async def _run(
        self, method: str, context: grpc.aio.ServicerContext, fn: Callable[[], T], *, batched: bool = False
    ) -> T:
        """Check the protocol version, run ``fn``, and turn a MurmurError into a one-line gRPC status.
        ``batched``: ``fn`` writes the ledger and shares its transaction (one fsync) with the calls
        that arrive with it (coordinator/group_commit.py); answered once that is on disk. A batched
        ``fn`` runs later, in the flusher, when its call may have ended (its client gave up): it
        must not touch ``context``, whose call gRPC has freed by then (reading its auth context
        there crashed the coordinator with a segfault in gRPC's core, at 10,000 nodes). So member
        calls read who calls first (``_member_run``)."""
        try:
            check_version(_metadata(context).get(VERSION_METADATA_KEY), who="client")
        except MurmurError as err:
            await self._refuse(method, context, err)
        return await self._answer(method, context, fn, batched)

    async def _answer(self, method: str, context: grpc.aio.ServicerContext, fn: Callable[[], T], batched: bool) -> T:
        """``fn``'s result (in the next batch if ``batched``), a MurmurError as a one-line status."""
        try:
            result = await self.group.run(fn) if batched else fn()
        except MurmurError as err:
            await self._refuse(method, context, err)
        self.stats.count(method, True)
        return result

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, err: MurmurError) -> NoReturn:
        """End the call with ``err`` as a one-line gRPC status."""
        self.stats.count(method, False)
        if isinstance(err, VersionMismatch):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        await context.abort(getattr(grpc.StatusCode, getattr(err, "code", "INVALID_ARGUMENT")), str(err))

    def _admin(self, context: grpc.aio.ServicerContext) -> None:
        given = _metadata(context).get(ADMIN_METADATA_KEY)
        if not given:
            raise _Unauthenticated(
                "this call needs the admin credential: pass --admin-key FILE (the coordinator wrote it "
                "next to its database as <db>.admin-key) or set MURMUR_ADMIN_KEY_FILE"
            )
        if not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            raise _Denied("the admin credential is wrong: use the <db>.admin-key file of this coordinator")

    async def _member_run(
        self, method: str, context: grpc.aio.ServicerContext, fn: Callable[[str, str], T]
    ) -> T:
        """A batched member call: ``fn(node id, run id)``, the caller's certificate read now, while
        its call is alive, and its membership checked in the batch (it may have changed since)."""
        try:
            check_version(_metadata(context).get(VERSION_METADATA_KEY), who="client")
            node_id = self._caller(context)
        except MurmurError as err:
            await self._refuse(method, context, err)
        return await self._answer(method, context, lambda: fn(node_id, self.membership.member(node_id)), True)

    def _node(self, context: grpc.aio.ServicerContext) -> tuple[str, str]:
        """(node id, run id) of the caller, from the certificate the mutual-TLS handshake verified."""
        node_id = self._caller(context)
        return node_id, self.membership.member(node_id)

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's node id, from its verified certificate (a stream reads it once: reading the
        auth context is a third of a streamed heartbeat's own Python time)."""
        auth = context.auth_context()
        names = auth.get("x509_common_name") or []
        if not names:
            raise _Unauthenticated(
                "member calls need the node certificate: call the coordinator's node address "
                "(the join reply names it) with mutual TLS"
            )
        return names[0].decode()

    # --- joining -------------------------------------------------------------------------------

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        def call() -> pb.JoinReply:
            hw = request.hardware
            joined = self.membership.join(
                request.token,
                bytes(request.csr_pem),
                {
                    "device": hw.device[:100],
                    "cpu_cores": hw.cpu_cores,
                    "memory_bytes": hw.memory_bytes,
                    "accelerator_memory_bytes": hw.accelerator_memory_bytes,
                },
                request.peer_address[:200],
                request.name[:200],
            )
            s = self.settings
            reply = pb.JoinReply(
                node_id=joined.node_id,
                run_id=joined.run_id,
                certificate_pem=joined.cert_pem,
                ca_certificate_pem=self.ca_cert_pem,
                config_toml=joined.config_toml,
                bootstrap_peers=self.bootstrap_peers,
                node_address=self.node_address,
                heartbeat_interval_s=s.heartbeat_interval_s,
                heartbeat_ttl_s=s.heartbeat_ttl_s,
                lease_ttl_s=s.lease_ttl_s,
                tls_server_name=TLS_SERVER_NAME,
                heartbeat_address=self.fronts.address_for(joined.node_id) if self.fronts is not None else "",
            )
            self._offer_datagrams(reply, joined.node_id)
            return reply

        return await self._run("Join", context, call, batched=True)  # a join storm: one fsync per batch

    # --- members -------------------------------------------------------------------------------

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply | bytes:
        # bytes: a reply with the whole view, sent as they are (coordinator/preserialized.py)
        return await self._run("Heartbeat", context, lambda: self._heartbeat(request, context).for_grpc())

    async def HeartbeatStream(
        self, requests: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatReply | bytes]:
        """Heartbeats on one long-lived stream per node, each answered as Heartbeat answers it (a
        message on an open stream costs far less than a unary call). A refusal ends the stream
        with Heartbeat's status and reason; the node opens a new stream for its next heartbeat."""
        try:
            check_version(_metadata(context).get(VERSION_METADATA_KEY), who="client")
        except VersionMismatch as err:
            self.stats.count("HeartbeatStream", False)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        self._streams.add(context)
        try:
            caller = None
            async for request in requests:
                try:
                    caller = caller or self._caller(context)
                    reply = self._heartbeat(request, context, caller)
                except MurmurError as err:
                    self.stats.count("HeartbeatStream", False)
                    code = getattr(grpc.StatusCode, getattr(err, "code", "INVALID_ARGUMENT"))
                    await context.abort(code, str(err))
                self.stats.count("HeartbeatStream", True)  # per heartbeat: murmur_rpc_calls_total{method}
                yield reply.for_grpc()
        finally:
            self._streams.discard(context)

    async def end_streams(self) -> None:
        """Stopping: every open heartbeat stream ends now (serving.end_streams)."""
        await end_streams(self._streams)

    def datagram_beat(self, node_id: str, request: pb.HeartbeatRequest) -> BeatReply:
        """A heartbeat that came as a datagram signed with ``node_id``'s key (coordinator/heartbeat_udp.py):
        answered as one on the stream; a refusal raises (the node then makes it over gRPC)."""
        try:
            reply = self._heartbeat(request, None, node_id, offer=False)  # type: ignore[arg-type]
        except MurmurError:
            self.stats.count("HeartbeatDatagram", False)
            raise
        self.stats.count("HeartbeatDatagram", True)
        return reply

    def _offer_datagrams(self, reply: pb.JoinReply | pb.HeartbeatReply, node_id: str) -> None:
        """The datagram address and the node's key, in a reply that goes over mutual TLS to the
        holder of node_id's certificate (or to the joiner it is issued to): nobody else learns it."""
        if self.datagrams is not None and self.datagrams.address:
            reply.heartbeat_udp_address = self.datagrams.address
            reply.heartbeat_udp_key = self.datagrams.key_for(node_id)

    def _heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext, caller: str = "", *, offer: bool = True
    ) -> BeatReply:
        """One heartbeat and its reply, unary, streamed or a datagram alike: membership (memory
        only), a stage peer's report, the view, the durability fields, the ban list when it changed.
        A whole view's members come as the bytes the view serialized once (coordinator/preserialized.py).
        ``caller``: the node id a stream read from its certificate already (or a datagram's key
        vouched for). ``offer``: the reply goes over gRPC, so it may carry the datagram key."""
        node_id = caller or self._caller(context)
        run_id = self.membership.member(node_id)
        peer = None
        if request.incarnation:
            peer = (request.incarnation, request.peer_address, request.round, request.state_hash)
        self.membership.heartbeat(node_id, request.tokens_per_s, peer, starting=request.starting)
        order = None
        if request.HasField("stage_peer"):
            order = self.stage_board.report(node_id, run_id, request.stage_peer)
        if request.measured:  # a pipeline driver's measurements of the stage peers
            self.stage_board.measured(node_id, run_id, list(request.measured)[:MAX_MEASURED])
        reply = pb.HeartbeatReply(
            run_state=self.membership.run_states.get(run_id, "finished"),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            lease_ttl_s=self.settings.lease_ttl_s,
        )
        members = b""
        if peer is not None:
            members = self._view_into(reply, run_id, node_id, request.view_version)
        self._durability_into(reply, run_id)
        if order is not None:
            reply.stage_order.CopyFrom(order)
        version = self.membership.ban_version
        if version != request.ban_list_version:
            reply.ban_list_changed = True
            reply.ban_list.version = version
            reply.ban_list.node_ids.extend(sorted(self.membership.banned()))
        if self.fronts is not None:  # where its stream goes from now on (coordinator/fronts.py)
            reply.heartbeat_address = self.fronts.address_for(node_id)
        if offer:
            self._offer_datagrams(reply, node_id)
        return BeatReply(reply, members)

    def front_beat(self, node_id: str, request: bytes) -> pb.FrontAnswer:
        """A heartbeat a front carried (coordinator/fronts.py), with the node id it read from the
        caller's certificate: answered as one on the node's own stream, a refusal included."""
        try:
            reply = self._heartbeat(pb.HeartbeatRequest.FromString(request), None, node_id)  # type: ignore[arg-type]
        except DecodeError as err:
            self.stats.count("HeartbeatStream", False)
            return pb.FrontAnswer(code="INVALID_ARGUMENT", details=f"malformed HeartbeatRequest: {str(err)[:200]}")
        except MurmurError as err:
            self.stats.count("HeartbeatStream", False)
            return pb.FrontAnswer(code=getattr(err, "code", "INVALID_ARGUMENT"), details=str(err))
        self.stats.count("HeartbeatStream", True)
        return pb.FrontAnswer(reply=reply.wire())

    def _durability_into(self, reply: pb.HeartbeatReply | pb.StatusReply, run_id: str = "") -> None:
        """When this process started, the state it keeps of the run, and whether the run waits for
        its operator (heartbeat replies, `admin status`, the page)."""
        run_id = run_id or reply.run.run_id  # type: ignore[union-attr]
        if isinstance(reply, pb.HeartbeatReply):
            reply.coordinator_started_at = self.started_at
        if self.keeper is not None:
            kept = self.keeper.kept_info(run_id)
            if kept is not None:
                reply.kept.CopyFrom(kept)
        if self.recovery is not None:
            reply.waiting_for_operator = self.recovery.waiting(run_id)

    def _view_into(
        self, reply: pb.HeartbeatReply | pb.ReportGoneReply, run_id: str, node_id: str, have: int = 0
    ) -> bytes:
        """A trainer's view: the run's live trainers, for its round groups; none while this
        coordinator has not yet heard from every live trainer (just started: a partial list is a split).
        A heartbeat whose node holds a recent version (``have``) is told what changed since, or that
        nothing did (coordinator/trainer_view.py); a ReportGone reply lists them as they are right
        after its losses. Returns a heartbeat reply's whole view as the serialized members to append
        to it (``View.members_field``: made once per version), else b"" (the reply carries the rest)."""
        members = b""
        if not self.membership.view_is_whole():
            return members
        if isinstance(reply, pb.HeartbeatReply):
            view = self.views.get(run_id)
            reply.view_version = view.version
            delta = self.views.delta(run_id, view, have) if have and have != view.version else None
            if have == view.version:
                reply.view_unchanged = True
            elif delta is not None:  # what changed since the node's version
                reply.view_delta = True
                reply.members.extend(delta.changed)
                reply.view_removed.extend(delta.removed)
            else:  # the whole view: its bytes, appended when the reply is sent
                members = view.members_field()
        else:
            reply.members.extend(self.views.get(run_id, fresh=True).members)
        reply.run_round = self.membership.trainers.run_round(run_id, node_id)
        reply.view_whole = True
        return members

    async def AcquireLease(
        self, request: pb.AcquireLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcquireLeaseReply:
        def call(node_id: str, run_id: str) -> pb.AcquireLeaseReply:
            self.membership.started(node_id)  # a lease is renewed by heartbeats: the TTL holds now
            shard, reason = self.leases.acquire(run_id, node_id, frozenset(list(request.exhausted)[:64]))
            if shard is None:
                return pb.AcquireLeaseReply(granted=False, reason=reason, status=reason.status)
            return pb.AcquireLeaseReply(
                granted=True,
                status=pb.LEASE_GRANTED,
                lease=pb.Lease(
                    lease_id=shard.lease_id,
                    shard_id=shard.shard_id,
                    shard_name=shard.name,
                    start_offset=shard.committed_offset,
                    end_offset=shard.tokens,
                    expires_at=shard.lease_expiry or 0.0,
                ),
            )

        return await self._member_run("AcquireLease", context, call)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitReply:
        def call(node_id: str, run_id: str) -> pb.CommitReply:
            if request.round_members:
                self._check_round(run_id, node_id, request)
            result = self.leases.commit(
                run_id,
                node_id,
                request.lease_id,
                request.shard_id,
                request.start_offset,
                request.end_offset,
                Progress(request.outer_step, request.loss, request.bytes_sent, request.seconds,
                         request.val_loss if request.HasField("val_loss") else None),
            )
            if result.shard_done and self.keeper is not None:
                self.keeper.lease_ended(run_id)  # the lease ended with its shard: keep the newest state
            return pb.CommitReply(
                duplicate=result.duplicate,
                committed_offset=result.committed_offset,
                shard_done=result.shard_done,
                run_tokens_committed=int(self.store.run_totals(run_id)["tokens_committed"]),
            )

        return await self._member_run("Commit", context, call)

    def _check_round(self, run_id: str, node_id: str, request: pb.CommitRequest) -> None:
        """Refuse (and count) a commit of tokens that reached a split's model, not the run's."""
        try:
            self.membership.check_round(run_id, node_id, request.outer_step, list(request.round_members)[:10_000])
        except SplitRound as err:
            with self.store.write():
                self.store.bump("commits_refused")
                self.store.event(
                    "commit_refused", run_id=run_id, node_id=node_id, shard=request.shard_id, why=str(err)[:200]
                )
            raise

    async def ClaimRound(self, request: pb.ClaimRoundRequest, context: grpc.aio.ServicerContext) -> pb.ClaimRoundReply:
        def call() -> pb.ClaimRoundReply:
            node_id, run_id = self._node(context)
            members = list(request.members)[:10_000]
            try:
                if request.lost_rounds:
                    scratch = False
                    if self.recovery is not None:  # the newest state that exists, or the operator's call
                        scratch = self.recovery.judge(run_id, request.round, max(0, request.from_round), node_id)
                    if self.stage_board.pipeline(run_id) is not None:
                        # A stage peer whose stage exists nowhere (node/pipeline/kept_stage.py): the
                        # judgement is all; it is no trainer and numbers no round of its own.
                        return pb.ClaimRoundReply(decided=True, from_scratch=scratch)
                    self.membership.claim_lost_rounds(run_id, request.round, node_id)
                    return pb.ClaimRoundReply(decided=True, from_scratch=scratch)
                decided = self.membership.claim_round(
                    run_id, request.round, request.key[:200], members, run_round=max(0, request.run_round)
                )
            except SplitRound as err:
                with self.store.write():
                    self.store.event(
                        "round_refused", run_id=run_id, node_id=node_id, round=request.round, why=str(err)[:200]
                    )
                raise
            return pb.ClaimRoundReply(decided=decided)

        return await self._run("ClaimRound", context, call)

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseReply:
        def call() -> pb.ReleaseLeaseReply:
            node_id, run_id = self._node(context)
            reply = pb.ReleaseLeaseReply(committed_offset=self.leases.release(node_id, request.lease_id))
            if self.keeper is not None:
                self.keeper.lease_ended(run_id)  # released (a driver at its schedule's end, a node leaving)
            return reply

        return await self._run("ReleaseLease", context, call)

    async def ReportCheckpoint(
        self, request: pb.ReportCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportCheckpointReply:
        def call() -> pb.ReportCheckpointReply:
            node_id, run_id = self._node(context)
            if request.step < 0 or not request.location or len(request.location) > 1000:
                raise RunError("a checkpoint needs a non-negative step and a location of at most 1000 chars")
            with self.store.write():
                self.store.insert_checkpoint(
                    run_id, request.step, request.location, request.sha256[:128], node_id, time.time()
                )
                self.store.event(
                    "checkpoint", run_id=run_id, node_id=node_id, step=request.step, location=request.location
                )
            if request.location.startswith("stage/") and self.stage_board.pipeline(run_id) is not None:
                self.stage_board.checkpoint_reported(run_id)  # a stage's: the newest complete set, recorded
            return pb.ReportCheckpointReply()

        return await self._run("ReportCheckpoint", context, call)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        if self.keeper is not None:
            # A leaver that holds a state newer than the kept one: pull it first, while its peer
            # server still serves it (bounded by keep.leave_pull_s). The call refuses strangers below.
            with contextlib.suppress(MurmurError):
                node_id, run_id = self._node(context)
                await self.keeper.pull_at_leave(run_id, node_id)

        def call() -> pb.LeaveReply:
            node_id, run_id = self._node(context)
            released = self.membership.leave(node_id, request.reason)
            tokens, _ = self.store.node_totals(node_id)
            return pb.LeaveReply(
                leases_released=released,
                tokens_committed=tokens,
                rounds=self.store.node_rounds(node_id),
                run_tokens_committed=self.store.run_totals(run_id)["tokens_committed"],
            )

        return await self._run("Leave", context, call)

    async def GetBanList(self, request: pb.GetBanListRequest, context: grpc.aio.ServicerContext) -> pb.BanList:
        def call() -> pb.BanList:
            self._node(context)
            version, ids = self.membership.ban_list()
            return pb.BanList(version=version, node_ids=ids)

        return await self._run("GetBanList", context, call)

    async def GetBootstrapPeers(
        self, request: pb.GetBootstrapPeersRequest, context: grpc.aio.ServicerContext
    ) -> pb.BootstrapPeers:
        def call() -> pb.BootstrapPeers:
            self._node(context)
            return pb.BootstrapPeers(multiaddrs=self.bootstrap_peers)

        return await self._run("GetBootstrapPeers", context, call)

    async def ReportRejections(
        self, request: pb.ReportRejectionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportRejectionsReply:
        def call() -> pb.ReportRejectionsReply:
            node_id, run_id = self._node(context)
            if len(request.rejected) > MAX_REJECTIONS_PER_REPORT:
                n = len(request.rejected)
                raise RunError(f"at most {MAX_REJECTIONS_PER_REPORT} rejections a report, got {n}")
            if any(r.round < 0 or not r.sender_node_id for r in request.rejected):
                raise RunError("a rejection needs a sender and a non-negative round")
            items = [(r.sender_node_id[:100], int(r.round), r.reason[:200]) for r in request.rejected]
            with self.store.write():
                recorded = self.store.record_rejections(run_id, node_id, items)
            return pb.ReportRejectionsReply(recorded=recorded)

        return await self._run("ReportRejections", context, call)

    async def ReportGone(self, request: pb.ReportGoneRequest, context: grpc.aio.ServicerContext) -> pb.ReportGoneReply:
        """Peers whose address refused the caller (members only: mTLS): each is dialed by the
        coordinator itself and lost at once if its own connect is refused too (coordinator/gone.py).
        The dials run in worker threads: the loop keeps serving meanwhile."""

        def call() -> tuple[str, str, list[tuple[str, str]]]:
            node_id, run_id = self._node(context)
            if len(request.peers) > MAX_GONE_PER_REPORT:
                raise RunError(f"at most {MAX_GONE_PER_REPORT} peers a report, got {len(request.peers)}")
            return node_id, run_id, [(p.node_id[:100], p.peer_address[:300]) for p in request.peers]

        node_id, run_id, peers = await self._run("ReportGone", context, call)
        reply = pb.ReportGoneReply(lost=await self.gone.verify(node_id, run_id, peers))
        self._view_into(reply, run_id, node_id)
        return reply

    async def CheckReachable(
        self, request: pb.CheckReachableRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckReachableReply:
        """Dial the node back (members only: mTLS). A plain TCP connect of a few seconds and
        nothing sent, so a member cannot use it for more than learning whether a port answers."""
        await self._run("CheckReachable", context, lambda: self._node(context))
        reachable, reason = await dial_back(request.peer_address)
        return pb.CheckReachableReply(reachable=reachable, reason=reason)

    async def GetStages(self, request: pb.GetStagesRequest, context: grpc.aio.ServicerContext) -> pb.StageMap:
        def call() -> pb.StageMap:
            _, run_id = self._node(context)
            smap = self.stage_board.stage_map(run_id)
            kept = self.keeper.kept_info(run_id) if self.keeper is not None and smap.stages else None
            if kept is not None and kept.stages:  # what a stage peer no live stage-mate serves restores
                smap.kept.CopyFrom(kept)
            return smap

        return await self._run("GetStages", context, call)

    # --- admin ---------------------------------------------------------------------------------

    def _admin_call(self, method: str, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> Awaitable[T]:
        def call() -> T:
            self._admin(context)
            return fn()

        return self._run(method, context, call)

    # The run and node views are built by status_report.py, which the status page shares.
    def _run_info(self, run_id: str) -> pb.RunInfo:
        return self.status.run_info(run_id)

    def _node_info(self, row: Any, full: bool = False) -> pb.NodeInfo:
        return self.status.node_info(row, full)

    def _token_info(self, row: Any) -> pb.TokenInfo:
        return pb.TokenInfo(
            token_id=row["token_id"],
            run_id=row["run_id"],
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            uses_left=row["uses_left"],
            max_uses=row["max_uses"],
            revoked=bool(row["revoked"]),
            note=row["note"],
        )

    def _default_run(self, run_id: str) -> str:
        return self.status.default_run(run_id)

    async def CreateRun(self, request: pb.CreateRunRequest, context: grpc.aio.ServicerContext) -> pb.RunInfo:
        def call() -> pb.RunInfo:
            run_id = self.runs.create(request.config_toml, request.manifest_json, request.run_id)
            self.membership.run_states[run_id] = "active"
            return self._run_info(run_id)

        return await self._admin_call("CreateRun", context, call)

    async def ListRuns(self, request: pb.ListRunsRequest, context: grpc.aio.ServicerContext) -> pb.RunList:
        return await self._admin_call(
            "ListRuns",
            context,
            lambda: pb.RunList(runs=[self._run_info(r["run_id"]) for r in self.store.runs()]),
        )

    async def ShowRun(self, request: pb.RunRef, context: grpc.aio.ServicerContext) -> pb.RunInfo:
        return await self._admin_call("ShowRun", context, lambda: self._run_info(self._default_run(request.run_id)))

    async def SetRunState(self, request: pb.SetRunStateRequest, context: grpc.aio.ServicerContext) -> pb.RunInfo:
        def call() -> pb.RunInfo:
            run_id = self._default_run(request.run_id)
            self.runs.set_state(run_id, request.state)
            self.membership.run_states[run_id] = request.state
            return self._run_info(run_id)

        return await self._admin_call("SetRunState", context, call)

    async def CreateToken(
        self, request: pb.CreateTokenRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateTokenReply:
        def call() -> pb.CreateTokenReply:
            new = self.runs.create_token(self._default_run(request.run_id), request.ttl_s, request.uses, request.note)
            row = self.store.token(new.token_id)
            return pb.CreateTokenReply(info=self._token_info(row), token=new.token)

        return await self._admin_call("CreateToken", context, call)

    async def ListTokens(self, request: pb.ListTokensRequest, context: grpc.aio.ServicerContext) -> pb.TokenList:
        return await self._admin_call(
            "ListTokens",
            context,
            lambda: pb.TokenList(tokens=[self._token_info(r) for r in self.store.tokens(request.run_id)]),
        )

    async def RevokeToken(self, request: pb.RevokeTokenRequest, context: grpc.aio.ServicerContext) -> pb.TokenInfo:
        def call() -> pb.TokenInfo:
            self.runs.revoke_token(request.token_id)
            return self._token_info(self.store.token(request.token_id))

        return await self._admin_call("RevokeToken", context, call)

    async def ListNodes(self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext) -> pb.NodeList:
        return await self._admin_call(
            "ListNodes",
            context,
            lambda: pb.NodeList(nodes=[self._node_info(r) for r in self.store.nodes(request.run_id, request.status)]),
        )

    def _node_row(self, node_id: str) -> Any:
        row = self.store.node(node_id)
        if row is None:
            raise NotFound(f"no node {node_id!r}; `murmur admin nodes list` shows the ids")
        return row

    async def ShowNode(self, request: pb.NodeRef, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        return await self._admin_call(
            "ShowNode", context, lambda: self._node_info(self._node_row(request.node_id), full=True)
        )

    async def BanNode(self, request: pb.BanRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        def call() -> pb.NodeInfo:
            self._node_row(request.node_id)
            self.membership.ban(request.node_id, request.reason[:200])
            return self._node_info(self._node_row(request.node_id))

        return await self._admin_call("BanNode", context, call)

    async def UnbanNode(self, request: pb.NodeRef, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        def call() -> pb.NodeInfo:
            self._node_row(request.node_id)
            self.membership.unban(request.node_id)
            return self._node_info(self._node_row(request.node_id))

        return await self._admin_call("UnbanNode", context, call)

    async def ListShards(self, request: pb.ListShardsRequest, context: grpc.aio.ServicerContext) -> pb.ShardList:
        def call() -> pb.ShardList:
            run_id = self._default_run(request.run_id)
            self.runs.get(run_id)
            return pb.ShardList(
                shards=[
                    pb.ShardInfo(
                        shard_id=s.shard_id,
                        name=s.name,
                        tokens=s.tokens,
                        committed_offset=s.committed_offset,
                        holder=s.holder or "",
                        lease_expires_at=s.lease_expiry or 0.0,
                        done=s.done,
                    )
                    for s in self.store.shards(run_id)
                ]
            )

        return await self._admin_call("ListShards", context, call)

    async def ListEvents(self, request: pb.ListEventsRequest, context: grpc.aio.ServicerContext) -> pb.EventList:
        def call() -> pb.EventList:
            limit = request.limit if 0 < request.limit <= 10_000 else 100
            rows = self.store.events(run_id=request.run_id, after_seq=request.after_seq, limit=limit, kind=request.kind)
            return pb.EventList(
                events=[
                    pb.Event(
                        seq=r["seq"],
                        at=r["at"],
                        run_id=r["run_id"],
                        kind=r["kind"],
                        node_id=r["node_id"],
                        detail=r["detail_json"],
                    )
                    for r in rows
                ]
            )

        return await self._admin_call("ListEvents", context, call)

    async def ListStages(self, request: pb.GetStagesRequest, context: grpc.aio.ServicerContext) -> pb.StageMap:
        def call() -> pb.StageMap:
            run_id = self._default_run(request.run_id)
            self._run_info(run_id)  # an unknown run is refused by name
            return self.stage_board.stage_map(run_id)

        return await self._admin_call("ListStages", context, call)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return await self._admin_call("Status", context, lambda: self.status.status_reply(request.run_id))

    async def ReadState(self, request: pb.ReadStateRequest, context: grpc.aio.ServicerContext) -> pb.ReadStateGrant:
        def call() -> pb.ReadStateGrant:
            run_id = self._default_run(request.run_id)
            info = self._run_info(run_id)  # an unknown run is refused by name
            csr = bytes(request.csr_pem)[:16384]
            if self.stage_board.pipeline(run_id) is not None:
                return self._read_stages(run_id, info, csr)
            try:
                grant = self.membership.grant_read(run_id, csr)
            except NoStateYet:
                kept = self._read_kept(run_id, info, csr)
                if kept is None:
                    raise
                return kept
            return pb.ReadStateGrant(
                run_id=run_id,
                certificate_pem=grant.cert_pem,
                ca_certificate_pem=self.membership.ca.cert_pem,
                config_toml=info.config_toml,
                round=grant.round,
                state_hash=grant.state_hash,
                holders=[
                    pb.LiveMember(node_id=n, incarnation=t.incarnation, peer_address=t.peer_address,
                                  round=t.round, state_hash=t.state_hash)
                    for n, t in grant.holders
                ],
                tokens_committed=info.tokens_committed,
            )

        return await self._admin_call("ReadState", context, call)

    def _read_kept(self, run_id: str, info: pb.RunInfo, csr: bytes) -> pb.ReadStateGrant | None:
        """A reader's pass to the coordinator's kept state, when no live node serves one."""
        k = self.keeper.kept(run_id) if self.keeper is not None else None
        if k is None or not self.node_address:
            return None
        cert = self.membership.reader_certificate(csr)
        grant = pb.ReadStateGrant(run_id=run_id, certificate_pem=cert, ca_certificate_pem=self.membership.ca.cert_pem,
                                  config_toml=info.config_toml, round=k.round,
                                  tokens_committed=info.tokens_committed, kept=True)
        me = pb.LiveMember(node_id=TLS_SERVER_NAME, peer_address=self.node_address, round=k.round)
        if k.kind == "global":
            grant.state_hash = k.states[0].state_hash.hex()
            me.state_hash = grant.state_hash
            grant.holders.append(me)  # GetState of kept_name(run, "state/<round>") at the coordinator
        else:
            for stage, st in zip(k.stages or [], k.states, strict=True):
                grant.stages.append(pb.StageState(stage=stage, name=kept_name(run_id, st.name),
                                                  state_hash=st.state_hash.hex(), holders=[me]))
        self._state_read_event(run_id, grant, cert)
        return grant

    def _read_stages(self, run_id: str, info: pb.RunInfo, csr: bytes) -> pb.ReadStateGrant:
        """A pipelined run: each stage's live peers that publish its state; else the kept set."""
        smap = self.stage_board.stage_map(run_id)
        stages = []
        for s in range(smap.stages):
            serving = [p for p in smap.peers if p.report.stage == s and p.report.state_hash
                       and p.report.state_address and self.membership.is_live(p.node_id)]
            if not serving:
                break
            stages.append(pb.StageState(stage=s, name=f"stage/{s}", state_hash=serving[0].report.state_hash, holders=[
                pb.LiveMember(node_id=p.node_id, peer_address=p.report.state_address, state_hash=p.report.state_hash,
                              round=p.report.optimizer_steps) for p in serving]))
        if len(stages) == smap.stages and stages:
            cert = self.membership.reader_certificate(csr)
            grant = pb.ReadStateGrant(run_id=run_id, certificate_pem=cert,
                                      ca_certificate_pem=self.membership.ca.cert_pem,
                                      config_toml=info.config_toml, tokens_committed=info.tokens_committed,
                                      round=min(h.round for st in stages for h in st.holders), stages=stages)
            self._state_read_event(run_id, grant, cert)
            return grant
        kept = self._read_kept(run_id, info, csr)
        if kept is None:
            raise NoStateYet(f"no live peer of run {run_id} serves stage {len(stages)}'s state, and the coordinator "
                             "keeps none yet; try again once every stage is served")
        return kept

    def _state_read_event(self, run_id: str, grant: pb.ReadStateGrant, cert: bytes) -> None:
        from murmur.protocol.identity import node_id_of_certificate

        with self.store.write():
            self.store.event("state_read", run_id=run_id, round=grant.round, state_hash=grant.state_hash,
                             kept=grant.kept, stages=len(grant.stages), reader=node_id_of_certificate(cert))

    async def RecoverRun(self, request: pb.RecoverRunRequest, context: grpc.aio.ServicerContext) -> pb.RunInfo:
        def call() -> pb.RunInfo:
            run_id = self._default_run(request.run_id)
            self._run_info(run_id)  # an unknown run is refused by name
            assert self.recovery is not None
            self.recovery.recover(run_id, request.start_from)
            return self._run_info(run_id)

        return await self._admin_call("RecoverRun", context, call)


class _Unauthenticated(MurmurError):
    code = "UNAUTHENTICATED"


class _Denied(MurmurError):
    code = "PERMISSION_DENIED"
