"""The node's session with the coordinator: join, heartbeats, leases and the commit journal.

Everything here runs on the daemon's asyncio loop. The training thread reaches it through the
thread's bridge (node/daemon/training_thread.py): it asks for leases and hands back commits.

Coordinator outage: heartbeats and commits fail, the session logs it once and the node keeps
training on the lease it holds; commits wait in the journal (the state folder) and are replayed,
in order, when the coordinator answers again. The member client's channel retries its connection
at most ``outage_retry_s`` apart, so the coordinator's return is seen at the next call after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterable

import grpc
import torch

from murmur.errors import MurmurError
from murmur.node.daemon.metrics import NodeMetrics
from murmur.node.daemon.run_view import RunView, new_incarnation
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import JoinRecord, PendingCommit, StateDir
from murmur.node.daemon.stop import StopSignal
from murmur.node.daemon.window_types import LeaseView
from murmur.node.net.loop import next_due
from murmur.node.net.member_folder import join_or_rejoin
from murmur.optim.exchange import ExchangeError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient
from murmur.protocol.lease_status import LeaseAction, status_name
from murmur.protocol.lease_status import action as lease_action


class SessionError(MurmurError):
    pass


# gRPC codes that mean "the coordinator is not there right now" (keep going, retry later),
# as opposed to a refusal (drop the call's work and say why).
OUTAGE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    None,
}


MAX_UNREPORTED_REJECTIONS = 10_000  # rejection reports kept through an outage (the oldest go first)
REJECTIONS_PER_REPORT = 500  # below the coordinator's limit of one ReportRejections call
GONE_PER_REPORT = 64  # the coordinator's limit of one ReportGone call
GIVE_UP_POLL_S = 0.05  # `acquire` with give_up: how often it looks while it waits (a round landing ends the wait)
LEASE_WAIT_GROWTH = 4  # waiting for a shard: the pause between asks grows to this many lease_wait_s
STARTING_CALL_S = 5.0  # the "starting" heartbeat before the data plane opens; past it, start anyway


def is_outage(err: CoordinatorError) -> bool:
    return err.code in OUTAGE_CODES


def hardware() -> pb.Hardware:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())  # --device cuda:N set it
        return pb.Hardware(
            device=f"cuda:{props.name}",
            cpu_cores=os.cpu_count() or 0,
            accelerator_memory_bytes=props.total_memory,
        )
    mem = 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return pb.Hardware(device="cpu", cpu_cores=os.cpu_count() or 0, memory_bytes=mem)


async def join(
    coordinator: str,
    token: str | None,
    state: StateDir,
    settings: NodeSettings,
    log: Callable[[str], None],
    name: str = "",
) -> tuple[JoinRecord, identity.Identity, str]:
    """The membership this state folder holds for ``coordinator``, else a new one from ``token``:
    (join info, identity, the run configuration as TOML). The member folder's rule
    (node/net/member_folder.py), which stage peers and drivers follow too."""
    return await join_or_rejoin(state, coordinator, token, log, hardware=hardware,
                                timeout_s=settings.join_timeout_s, name=name)


def contribution(reply: pb.LeaveReply) -> str:
    """What this node gave the run, as the ledger counts it (tokens of refused commits are not in)."""
    share = 100.0 * reply.tokens_committed / reply.run_tokens_committed if reply.run_tokens_committed else 0.0
    return (
        f"this node committed {reply.tokens_committed:,} tokens in {reply.rounds} round(s), {share:.1f}% of the "
        f"{reply.run_tokens_committed:,} the run has committed"
    )


class CoordinatorSession:
    """A joined node's calls to the coordinator, and what it must remember across an outage."""

    def __init__(
        self,
        info: JoinRecord,
        ident: identity.Identity,
        *,
        settings: NodeSettings,
        state: StateDir,
        metrics: NodeMetrics,
        stop: StopSignal,
        log: Callable[[str], None],
    ) -> None:
        self.info, self.s, self.state, self.metrics, self.stop, self.log = info, settings, state, metrics, stop, log
        self.client = MemberClient(
            info.node_address,
            ident,
            server_name=info.tls_server_name,
            timeout_s=settings.rpc_timeout_s,
            reconnect_backoff_s=settings.outage_retry_s,
        )
        self.pending: deque[PendingCommit] = deque(state.load_pending())  # the journal, oldest first
        metrics.pending_commits = len(self.pending)
        self.lost_leases: set[str] = set()  # leases whose commits were refused (read by the training thread)
        # The round groups of commits refused as a split: this node's state is the split's, not
        # the run's; the training thread re-syncs from trainers outside the group (then clears it).
        self.split_groups: list[frozenset[str]] = []
        self.current_lease: LeaseView | None = None
        # Held leases whose shard ran out in the window under way: committed with its round, so
        # ``acquire`` asks for another shard beside them (the training thread fills it).
        self.exhausted: set[str] = set()
        self.coordinator_up = True
        # What the coordinator keeps of the run (pb.KeptState, round -1: nothing) and whether the
        # run waits for its operator, from the latest heartbeat reply (coordinator/keeper.py).
        self.kept: pb.KeptState = pb.KeptState(round=-1)
        self.waiting_for_operator = ""
        self.from_scratch = False  # the last lost-rounds grant said: go on from a fresh model
        # When the coordinator's process started serving: a change is a restart. Called then: the
        # node dials the coordinator's DHT peer again.
        self._coordinator_started_at = 0.0
        self.on_coordinator_back: Callable[[], None] | None = None
        self.tokens_per_s = 0.0  # what the heartbeats report; the training thread sets it after each round
        # The run round the window under way completes (the training thread sets it before each
        # window): claims name it, and a grant makes it the run's newest round at the coordinator.
        self.window_round = 0
        # This process's place on the data plane, reported with every heartbeat; the reply's live
        # trainers land in ``view`` (node/daemon/run_view.py). peer_address stays empty until the
        # node holds the run's state and takes part in rounds (the training thread sets it, and round/hash).
        self.incarnation = new_incarnation()
        self.peer_address = ""
        self.round, self.state_hash = -1, ""
        self.view = RunView(info.node_id, self.incarnation, fresh_s=max(3.0, 3 * (info.heartbeat_ttl_s or 10.0)))
        self.viewed = asyncio.Event()  # set by the first heartbeat reply
        self.in_rounds = False  # a peer data plane: heartbeats report it, commits name round groups
        # Waiting for a shard (every unfinished one leased to others): out of the rounds meanwhile.
        # Its heartbeats report no peer address, so the trainers still training do not count it
        # in their quorum nor wait for it at their rendezvous (one of two nodes waiting held the
        # other's every round); it reports its address again with its next lease.
        self.waiting_for_shard = False
        # (round, sender, reason) of updates this node refused as an owner, not reported yet; sent
        # after heartbeats. Kept in memory only: a crash loses at most these reports.
        self.unreported: deque[tuple[int, str, str]] = deque(maxlen=MAX_UNREPORTED_REJECTIONS)
        # Peers this node saw die (their address refused a connect): reported to the coordinator
        # at once (ReportGone), which checks and lists them as lost without waiting out their TTL.
        self._gone_wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.view.on_gone = self._wake_reporter
        self._commit_wakeup = asyncio.Event()
        self._commit_lock = asyncio.Lock()  # the committer task and the shutdown both flush
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []

    async def starting(self) -> None:
        """Before the data plane opens (heartbeats start only after it: the DHT's process is
        forked, never under live gRPC calls): one heartbeat that says this process is starting,
        so the coordinator gives it join_grace_s, not the heartbeat TTL, for its next one. A
        restarted testnet node (TTL 3 s) was marked lost while its DHT started. Bounded; an
        outage or a refusal is left to the heartbeats that follow. It names this process's
        incarnation (no peer address yet): the coordinator stops listing the previous process as a
        live trainer at once, so the others neither wait for it nor count it for their quorum."""
        peer = pb.HeartbeatRequest(incarnation=self.incarnation) if self.in_rounds else None
        with contextlib.suppress(CoordinatorError, TimeoutError):
            await asyncio.wait_for(
                self.client.heartbeat(0.0, "starting", peer=peer, starting=True), STARTING_CALL_S
            )

    def start(self) -> None:
        """Heartbeats and the committer, as tasks of the running loop until ``close`` (once)."""
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._committer()),
            asyncio.create_task(self._reporting_gone()),
        ]

    def published(self, round_id: int, state_hash: str, address: str) -> None:
        """The node holds (and serves) the state of ``round_id``: it is a trainer in rounds now."""
        self.round, self.state_hash, self.peer_address = round_id, state_hash, address

    # -- outages ---------------------------------------------------------------------------------

    def _mark(self, up: bool, err: CoordinatorError | None = None) -> None:
        if up and not self.coordinator_up:
            self.log("coordinator is back: replaying pending commits")
        elif not up and self.coordinator_up:
            self.log(f"coordinator unreachable ({err}); training goes on, commits wait in the journal")
        self.coordinator_up = up
        self.metrics.coordinator_up = int(up)

    async def _heartbeats(self) -> None:
        # Until close() cancels it, not until the stop: the window in flight when a SIGTERM comes
        # still completes its round and commits it, and its lease must live until then (a testnet's
        # 6 s lease expired under a GPU node's last round, and its commit was refused).
        # On a fixed cadence (next_due), not an interval after each reply.
        interval = self.info.heartbeat_interval_s or 1.0
        due = time.monotonic()
        while not self._closing:
            try:
                peer = None
                if self.in_rounds:
                    peer = pb.HeartbeatRequest(
                        incarnation=self.incarnation,
                        peer_address="" if self.waiting_for_shard else self.peer_address,
                        round=self.round,
                        state_hash=self.state_hash,
                    )
                reply = await self.client.heartbeat(self.tokens_per_s, "training", peer=peer)
                if reply.view_whole:  # not yet right after a coordinator restart: it means nothing then
                    self.view.update(self.client.members(reply), reply.run_round)
                self._durability(reply)
                self.viewed.set()
                self._mark(True)
                if self.pending:
                    self._commit_wakeup.set()
                if reply.heartbeat_interval_s > 0:
                    interval = reply.heartbeat_interval_s
                if reply.run_state == "finished" and not self.stop.is_set():
                    self.stop.request("the run is finished")
                if self.unreported:
                    await self._report_rejections()
            except CoordinatorError as err:
                if is_outage(err):
                    self._mark(False, err)
                else:
                    self.log(f"heartbeat refused: {err}")
            due = next_due(due, interval)
            if self.stop.is_set():
                await asyncio.sleep(due - time.monotonic())  # stop.sleep no longer waits once the stop is asked for
            else:
                await self.stop.sleep(due - time.monotonic())

    def _durability(self, reply: pb.HeartbeatReply) -> None:
        """The kept state, a wait for the operator, and a coordinator restart, from a reply."""
        self.kept = reply.kept if reply.HasField("kept") and reply.kept.address else pb.KeptState(round=-1)
        if reply.waiting_for_operator != self.waiting_for_operator and reply.waiting_for_operator:
            self.log(f"the run waits for its operator: {reply.waiting_for_operator}")
        self.waiting_for_operator = reply.waiting_for_operator
        started = reply.coordinator_started_at
        if started and self._coordinator_started_at and started != self._coordinator_started_at:
            # It restarted (seen through an outage or not: a quick restart fails no call): its DHT
            # is a new process that knows only who bootstrapped since.
            if self.on_coordinator_back is not None:
                self.on_coordinator_back()
        if started:
            self._coordinator_started_at = started

    # -- peers seen dead ---------------------------------------------------------------------------

    def _wake_reporter(self) -> None:
        """A death was queued (on the loop or a DHT worker thread): report it now."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: the node is shutting down
            self._loop.call_soon_threadsafe(self._gone_wakeup.set)

    async def _reporting_gone(self) -> None:
        """Report the peers this node saw die as soon as it sees them (node/daemon/run_view.py).
        The coordinator dials each itself and marks the dead ones lost; its reply's view then
        drops them, so this node's quorum no longer counts them (and neither does ClaimRound)
        without waiting for the next heartbeat. Through an outage the reports are dropped: the
        heartbeat TTL marks those peers lost in the end anyway."""
        while not self._closing:
            await self._gone_wakeup.wait()
            self._gone_wakeup.clear()
            gone = self.view.take_gone()
            for i in range(0, len(gone), GONE_PER_REPORT):
                batch = gone[i : i + GONE_PER_REPORT]
                try:
                    reply = await self.client.report_gone(batch)
                except CoordinatorError as err:
                    if is_outage(err):
                        self._mark(False, err)
                    else:
                        self.log(f"the coordinator refused a report of {len(batch)} dead peer(s): {err}")
                    continue
                self._mark(True)
                if reply.view_whole:
                    self.view.update(reply.members, reply.run_round)
                if reply.lost:
                    self.log(f"the coordinator lists {', '.join(reply.lost)} as lost (their address refused a connect)")

    # -- the arbiter of round groups -------------------------------------------------------------

    async def claim(self, round_id: int, key: str, members: list[str]) -> None:
        """The exchange's RoundGate (node/exchange/group.py): before this node applies or serves a
        round's result, the coordinator must grant the round to its group. A refusal (a split:
        another group holds the round, or this one is a minority of the live trainers) raises
        ExchangeError, so the round fails here and the node re-syncs from the run. Through an
        outage, or while a restarted coordinator cannot judge yet, the exchange's quorum decides."""
        if not self.coordinator_up:
            return
        try:
            await self.client.claim_round(round_id, key, members, run_round=self.window_round)
        except CoordinatorError as err:
            if err.code == grpc.StatusCode.ABORTED:
                raise ExchangeError(f"the coordinator refused this group's round {round_id}: {err}") from None
            if is_outage(err):
                self._mark(False, err)
            else:
                self.log(f"the coordinator could not judge round {round_id}'s group ({err}); the quorum decides")

    async def claim_lost_rounds(self, round_id: int, from_round: int = 0) -> bool:
        """May this node go on from its own state (of round ``from_round``) numbered as
        ``round_id`` (the holders of the rounds past its state are gone)? False when the
        coordinator granted that number to another live node (take that node's state instead),
        keeps a newer state (restore from it), or the run waits for its operator
        (coordinator/recovery.py). Through an outage the node decides alone (the gap
        failure-model.md names). ``from_scratch`` says whether the grant is from a fresh model."""
        self.from_scratch = False
        if not self.coordinator_up:
            return True
        try:
            reply = await self.client.claim_lost_rounds(round_id, from_round)
            self.from_scratch = reply.from_scratch
        except CoordinatorError as err:
            if err.code == grpc.StatusCode.ABORTED:
                self.log(f"not numbering this node's state as round {round_id}: {err}")
                return False
            if is_outage(err):
                self._mark(False, err)
            else:
                self.log(f"the coordinator could not judge this node's numbering as round {round_id} ({err})")
        return True

    # -- bootstrap peers and rejected updates ----------------------------------------------------

    async def bootstrap_peers(self) -> list[str] | None:
        """The DHT bootstrap peers the coordinator hands out now (saved in the join record when
        they changed); None when it cannot be asked, with the reason logged."""
        try:
            peers = await self.client.bootstrap_peers()
        except CoordinatorError as err:
            self.log(f"cannot ask the coordinator for its DHT bootstrap peers ({err})")
            return None
        if peers and peers != self.info.bootstrap_peers:
            self.info.bootstrap_peers = list(peers)
            self.state.save_join_record(self.info)
        return peers

    async def check_reachable(self, peer_address: str) -> tuple[bool, str] | None:
        """(reachable, why not) as the coordinator sees ``peer_address`` when it dials it back;
        None when it cannot be asked (an outage, or a coordinator without the call), logged."""
        try:
            return await self.client.check_reachable(peer_address)
        except CoordinatorError as err:
            self.log(f"cannot ask the coordinator whether peers can reach {peer_address} ({err})")
            return None

    def queue_rejections(self, rejected: Iterable[tuple[int, str, str]]) -> None:
        """Updates this node refused as an owner: logged, and reported after the next heartbeat."""
        for round_id, sender, reason in rejected:
            self.log(f"refused the update of {sender} in round {round_id}: {reason}")
            self.unreported.append((round_id, sender, reason))

    async def _report_rejections(self) -> None:
        while self.unreported:
            batch = [self.unreported[i] for i in range(min(REJECTIONS_PER_REPORT, len(self.unreported)))]
            try:
                await self.client.report_rejections(batch)
            except CoordinatorError as err:
                if is_outage(err):
                    return  # kept: the next heartbeat that gets through sends them
                self.log(f"the coordinator refused a report of {len(batch)} rejected updates: {err}")
            for _ in batch:
                self.unreported.popleft()

    # -- the commit journal ----------------------------------------------------------------------

    def queue_commits(self, commits: Iterable[PendingCommit]) -> None:
        for c in commits:
            if len(self.pending) >= self.s.max_pending_commits:
                self.log(f"more than {self.s.max_pending_commits} commits pending: dropping the oldest")
                self.pending.popleft()
            self.pending.append(c)
        self._save_journal()
        self._commit_wakeup.set()

    async def _committer(self) -> None:
        while True:
            await self.flush_commits()
            if self.stop.is_set() and not self.pending:
                return
            self._commit_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_wakeup.wait(), self.s.outage_retry_s)
            if self._closing:
                return

    async def flush_commits(self) -> bool:
        """Send pending commits in order; False if the coordinator is unreachable."""
        async with self._commit_lock:
            while self.pending:
                c = self.pending[0]
                try:
                    await self.client.commit(
                        c.lease_id,
                        c.shard_id,
                        c.start_offset,
                        c.end_offset,
                        outer_step=c.outer_step,
                        loss=c.loss,
                        bytes_sent=c.bytes_sent,
                        seconds=c.seconds,
                        round_members=c.round_members if self.in_rounds else (),
                        val_loss=c.val_loss,
                    )
                    self._mark(True)
                    self.metrics.commits_total += 1
                except CoordinatorError as err:
                    if is_outage(err):
                        self._mark(False, err)
                        return False
                    # Refused (lease expired and re-leased, a span out of order): this work is counted
                    # by whoever holds the shard now. Drop it and the lease's later commits.
                    self.log(f"commit of shard {c.shard_id} [{c.start_offset}, {c.end_offset}) refused: {err}")
                    self.lost_leases.add(c.lease_id)
                    if err.code == grpc.StatusCode.ABORTED and c.round_members:  # a split's round
                        self.split_groups.append(frozenset(c.round_members))
                self.pending.popleft()
                self._save_journal()
            return True

    def _save_journal(self) -> None:
        self.state.save_pending(list(self.pending))
        self.metrics.pending_commits = len(self.pending)

    # -- leases ----------------------------------------------------------------------------------

    async def acquire(self, give_up: Callable[[], bool] | None = None, *, may_end_window: bool = False
                      ) -> LeaseView | None:
        """A lease to train on, waiting through outages and busy shards; None once the node stops,
        or (``give_up``, polled while it waits) once that says so, or (``may_end_window``: a shard
        ran out in the window under way) at once when no shard is free: the window ends with the
        steps it has (node/daemon/window.py), since waiting mid-window for a shard held by
        another node that waits the same way would hold both for good at a run's end.

        The coordinator's typed status decides (protocol/lease_status.py): every shard done or
        the run finished stops the node; every unfinished shard leased to others, or the run
        paused, waits, asking again after ``lease_wait_s``, then after longer pauses up to
        LEASE_WAIT_GROWTH times that (heartbeats go on meanwhile), out of the rounds
        (``waiting_for_shard``). A lease whose holder died expires (``lease_ttl_s``) and comes
        back to the pool: a waiting node takes it over, so the run trains its every shard."""
        try:
            return await self._acquire(give_up, may_end_window)
        finally:
            self.waiting_for_shard = False

    async def _acquire(self, give_up: Callable[[], bool] | None, may_end_window: bool) -> LeaseView | None:
        wait = self.s.lease_wait_s
        while not self.stop.is_set():
            # The coordinator hands back a held lease until its shard is done, or while it is
            # named as exhausted (run out by a window whose commits have not gone out): commits first.
            if not await self.flush_commits():
                if await self._wait_unless(give_up, self.s.outage_retry_s):
                    return None
                continue
            try:
                reply = await self.client.acquire(sorted(self.exhausted))
                self._mark(True)
            except CoordinatorError as err:
                if not is_outage(err):
                    raise SessionError(f"the coordinator refused a lease: {err}") from None
                self._mark(False, err)
                if await self._wait_unless(give_up, self.s.outage_retry_s):
                    return None
                continue
            act = lease_action(reply)
            if act is LeaseAction.TRAIN:
                lease = reply.lease
                if self.waiting_for_shard:
                    self.log("a shard came free: back in the rounds")
                self.lost_leases.discard(lease.lease_id)
                view = LeaseView(lease.lease_id, int(lease.shard_id), int(lease.start_offset), int(lease.end_offset))
                self.current_lease = view
                self.log(
                    f"leased shard {view.shard_id} from offset {view.start_offset:,} "
                    f"({view.end_offset - view.start_offset:,} tokens left)"
                )
                return view
            if act is LeaseAction.STOP:
                self.stop.request(f"nothing left to train: {reply.reason or status_name(reply)}")
                return None
            if may_end_window:
                return None
            if give_up is None and not self.waiting_for_shard:
                self.log(f"no shard to train ({reply.reason or status_name(reply)}): waiting for one, "
                         "out of the rounds meanwhile")
                self.waiting_for_shard = True
            if await self._wait_unless(give_up, wait):
                return None
            wait = min(wait * 1.5, self.s.lease_wait_s * LEASE_WAIT_GROWTH)
        return None

    async def _wait_unless(self, give_up: Callable[[], bool] | None, seconds: float) -> bool:
        """Sleep ``seconds`` (a stop ends it); True, at once, when ``give_up`` says so (it is
        looked at every GIVE_UP_POLL_S meanwhile)."""
        if give_up is None:
            await self.stop.sleep(seconds)
            return False
        end = asyncio.get_running_loop().time() + seconds
        while not give_up():
            left = end - asyncio.get_running_loop().time()
            if left <= 0 or self.stop.is_set():
                return False
            await self.stop.sleep(min(GIVE_UP_POLL_S, left))
        return True

    # -- leaving ---------------------------------------------------------------------------------

    async def close(self, left: Callable[[], float], *, leave: bool = True) -> None:
        """Commit, release, leave; each step bounded by ``left()`` seconds, so a dead coordinator
        cannot hold the exit. Commits it did not take stay in the journal for the next start.
        ``leave=False`` (a node that failed to start) keeps the membership for the next start."""
        with contextlib.suppress(TimeoutError, CoordinatorError):
            await asyncio.wait_for(self.flush_commits(), left())
        self._closing = True
        self._commit_wakeup.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # The refusals of the last rounds too (the heartbeat that would carry them is gone now).
        with contextlib.suppress(TimeoutError, CoordinatorError):
            await asyncio.wait_for(self._report_rejections(), left())
        if self.pending:
            self.log(f"{len(self.pending)} commits still pending (kept in {self.state.journal_path})")
        lease = self.current_lease
        if lease is not None and lease.lease_id not in self.lost_leases:
            with contextlib.suppress(TimeoutError, CoordinatorError):
                await asyncio.wait_for(self.client.release(lease.lease_id), left())
                self.log(f"released the lease on shard {lease.shard_id}")
        if not leave:
            self.log(f"kept the membership in {self.state.root}: a restart rejoins as {self.info.node_id}")
        elif not self.pending:
            if self.in_rounds and self.peer_address:
                # The coordinator pulls the state a leaver holds before answering its leave, if it is
                # newer than the one it keeps (coordinator/keeper.py): tell it the newest round first
                # (the last round under way may have completed after the last heartbeat).
                with contextlib.suppress(TimeoutError, CoordinatorError):
                    peer = pb.HeartbeatRequest(incarnation=self.incarnation, peer_address=self.peer_address,
                                               round=self.round, state_hash=self.state_hash)
                    await asyncio.wait_for(self.client.heartbeat(self.tokens_per_s, "leaving", peer=peer), left())
            try:
                reply = await asyncio.wait_for(self.client.leave(self.stop.reason[:200]), left())
                self.state.forget_join()  # a left node joins afresh next time
                self.log("left the run: " + contribution(reply))
            except (TimeoutError, CoordinatorError) as err:
                self.log(f"could not say goodbye to the coordinator ({err}); its lease expires on its own")
        with contextlib.suppress(Exception):
            await self.client.close()
