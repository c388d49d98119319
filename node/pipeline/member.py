"""A pipeline process's membership of the run: join with a token, heartbeats, a driver's lease
and its commits, through the coordinator's member protocol (protocol/coordinator_client.py).
This is the member's side; the coordinator's register of all members is coordinator/membership.py.

With a state folder (the processes' ``--state-dir``) the key, certificate and join record are
kept there (node/net/member_folder.py, as `murmur node run` keeps them): a restarted stage peer or
driver rejoins as the same node without a token, so the coordinator treats it as itself (a
driver's lease is still its own; a stage peer's entry is replaced, not doubled).

Stage peers join for their certificate and heartbeat to stay members; in a pipelined run (a
``[pipeline]`` section in the run config) each heartbeat carries the peer's `StageReport` and
its reply may carry a `StageOrder` (coordinator/stage_board.py), handed to ``on_order``. A driver
also leases a shard and commits the token ranges of completed microbatches, in order: the ledger's rule
(a commit starts at the shard's committed offset) is the same one `CommitWindow` keeps.

Not yet here (the daemon's session has them, node/daemon/session.py): the commit journal that
survives a restart and the replay after a coordinator outage. A driver retries a commit the
coordinator did not answer every ``COMMIT_RETRY_S`` until it goes through, holding further commits
back meanwhile; a refused one (the lease lost) is not retried: the driver leases again and
resumes from the ledger's offset (node/pipeline/driver_process.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from murmur.node.net.loop import next_due
from murmur.node.net.member_folder import MemberFolder, join_or_rejoin, saved_membership
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, JoinInfo, MemberClient, join_run

log = logging.getLogger(__name__)

COMMIT_RETRY_S = 1.0  # between attempts at a commit the coordinator did not take
COMMIT_ATTEMPTS = 30
# Answers that another attempt cannot change: the lease is lost or the commit is wrong.
REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.PERMISSION_DENIED)


@dataclass(slots=True)
class PipelineMember:
    ident: identity.Identity
    info: JoinInfo
    client: MemberClient
    _beats: asyncio.Task | None = None
    # A stage peer: what each heartbeat reports, and who hears the coordinator's orders.
    report: Callable[[], pb.StageReport] | None = None
    on_order: Callable[[pb.StageOrder], None] | None = None
    # A driver: its measurements of the stage peers, sent with each heartbeat (the rebalancing's).
    measured: Callable[[], list[pb.MeasuredRate]] | None = None

    # Joined with the saved record of a state folder: the coordinator knows this node id already
    # (the process restarted), so a stage peer reports itself starting before it loads its stage.
    rejoined: bool = False
    folder: MemberFolder | None = None  # held (and locked) while the member lives

    @classmethod
    async def join(cls, coordinator: str, token: str, folder: MemberFolder | None = None) -> PipelineMember:
        """Join with ``token``; with a state ``folder``, keep the identity and join record there
        and rejoin with them on a restart (node/net/member_folder.py: no token needed then). The
        folder is locked for the process's life: two processes with one identity would fight."""
        if folder is None:
            ident, info = await join_run(coordinator, token, identity.generate_key())
            return cls.joined(ident, info)
        folder.lock()
        rejoining = saved_membership(folder, coordinator) is not None
        record, ident, config = await join_or_rejoin(folder, coordinator, token, log.info)
        member = cls.joined(ident, record.join_info(config))
        member.rejoined, member.folder = rejoining, folder
        return member

    @classmethod
    def joined(cls, ident: identity.Identity, info: JoinInfo) -> PipelineMember:
        """The member of a node that already joined (`murmur node run`, whose state folder keeps
        its identity): heartbeats from now on, no use of a token."""
        client = MemberClient(info.node_address, ident, server_name=info.tls_server_name,
                              reconnect_backoff_s=info.heartbeat_interval_s)
        member = cls(ident, info, client)
        member._beats = asyncio.create_task(member._heartbeats())
        return member

    async def _heartbeats(self) -> None:
        due = time.monotonic()
        while True:
            await self.beat()
            due = next_due(due, self.info.heartbeat_interval_s)  # a fixed cadence
            await asyncio.sleep(due - time.monotonic())

    async def beat(self) -> None:
        """One heartbeat now (a stage peer sends one as soon as its stage changes)."""
        extra = pb.HeartbeatRequest(stage_peer=self.report()) if self.report is not None else None
        if self.measured is not None:
            extra = extra or pb.HeartbeatRequest()
            extra.measured.extend(self.measured())
        try:
            reply = await self.client.heartbeat(state="pipeline", peer=extra)
        except CoordinatorError as err:
            log.warning("heartbeat failed: %s", err)
            return
        if reply.HasField("stage_order") and self.on_order is not None:
            self.on_order(reply.stage_order)

    async def stages(self) -> pb.StageMap:
        return await self.client.stages()

    async def acquire(self) -> pb.Lease:
        reply = await self.client.acquire()
        if not reply.granted:
            raise CoordinatorError("AcquireLease", None, f"no lease: {reply.reason}")
        return reply.lease

    async def commit(
        self, lease: pb.Lease, start: int, end: int, *, loss: float, seconds: float, step: int = 0,
        val_loss: float | None = None,
    ) -> pb.CommitReply:
        """Commit [start, end) of the lease; ``step``: the run's step it lands at (the ledger's
        round, what the status page charts). A refusal (the lease is lost, the span does not follow
        the ledger's offset) raises at once; an unreachable coordinator is retried."""
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                return await self.client.commit(lease.lease_id, lease.shard_id, start, end, outer_step=step,
                                                loss=loss, seconds=seconds, val_loss=val_loss)
            except CoordinatorError as err:
                if attempt == COMMIT_ATTEMPTS - 1 or err.code in REFUSALS:
                    raise
                await asyncio.sleep(COMMIT_RETRY_S)
        raise AssertionError("unreachable")

    async def close(self, lease: pb.Lease | None = None) -> None:
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        if lease is not None:
            with contextlib.suppress(CoordinatorError):
                await self.client.release(lease.lease_id)
        await self.client.close()
        if self.folder is not None:
            self.folder.unlock()
