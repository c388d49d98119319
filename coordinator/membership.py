"""Who is in the run: joining with a token, heartbeats, lost nodes, leaving, bans.

Heartbeats are the hottest call (every node, every second), so they touch only memory: the last
time and throughput per node (``_seen``). Liveness is decided from that memory: the sweeper marks
silent nodes lost, and a lease is alive until max(stored expiry, last heartbeat + lease TTL). The
ledger gets the heartbeats every ``heartbeat_flush_s`` in one batched transaction, for `admin`
and for restarts. Losing the last few seconds of heartbeats in a crash is harmless: after a
restart every deadline is pushed out anyway (Store.push_deadlines).
"""

from __future__ import annotations

import datetime as dt
import hmac
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from murmur.errors import MurmurError
from murmur.protocol import identity
from murmur.protocol.jointoken import JoinToken, JoinTokenError, secret_hash
from murmur.protocol.node_name import check_node_name
from murmur.protocol.reachability import is_client
from murmur.protocol.state_vote import agreed_state

from .leases import Leases
from .settings import CoordinatorSettings
from .store import Store
from .trainers import Trainer, Trainers


class MembershipError(MurmurError):
    code = "PERMISSION_DENIED"


class JoinRefused(MembershipError):
    pass


class NoStateYet(MembershipError):
    code = "FAILED_PRECONDITION"


# A reader's certificate (`murmur export --coordinator`) lasts long enough to fetch the largest
# state and no longer: it is no member, and nobody renews it.
READER_CERT_VALIDITY = dt.timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class ReadGrant:
    cert_pem: bytes
    round: int
    state_hash: str
    holders: list[tuple[str, Trainer]]


class NotMember(MembershipError):
    code = "NOT_FOUND"


@dataclass(slots=True)
class Joined:
    node_id: str
    run_id: str
    cert_pem: bytes
    config_toml: str


class Membership:
    def __init__(
        self,
        store: Store,
        settings: CoordinatorSettings,
        ca: identity.CertificateAuthority,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.ca = ca
        self.clock = clock
        now = clock()
        # node id -> (last heartbeat, tokens/s) of every active node; _dirty: not yet in the ledger
        self._seen: dict[str, tuple[float, float]] = {
            r["node_id"]: (max(r["last_heartbeat"], now), r["tokens_per_s"]) for r in store.nodes(status="active")
        }
        # Insertion-ordered: the sweeps write the longest-waiting first (flush_due).
        self._dirty: dict[str, None] = {}
        # node id -> until when a node that joined, or said it is starting, and has not heartbeated
        # since is not lost (it starts its peer server and DHT first: settings.join_grace_s).
        # Memory only: after a coordinator restart, restart_grace_s covers it.
        self._starting: dict[str, float] = {}
        self._flushed_at = now
        self.ban_version = store.counter("ban_version")
        self._banned: tuple[int, dict[str, str]] = (-1, {})  # (ban_version, the list): see banned()
        self.run_states: dict[str, str] = {r["run_id"]: r["state"] for r in store.runs()}
        # The node's run, status and ban state, cached for the hot path; rebuilt on every change.
        self._nodes: dict[str, tuple[str, str]] = {r["node_id"]: (r["run_id"], r["status"]) for r in store.nodes()}
        self.leases = Leases(store, settings, last_seen=self.last_seen, clock=clock)
        # Trainers' incarnations, peer addresses and rounds (memory only: they heartbeat again
        # within a second of a restart), and the round groups commits are checked against.
        self.trainers = Trainers(settle_s=2 * settings.heartbeat_ttl_s, clock=clock)
        # The run's newest round survives a restart through the ledger's rounds: a node that comes
        # back to a run whose every holder is gone must know how far it got, not take round 0 as
        # the run's (it would go on from its own state as the run's, silently).
        for r in store.runs():
            last = store.last_round(r["run_id"])
            if last is not None:
                self.trainers.newest[r["run_id"]] = int(last["outer_step"])
        # After a restart nobody could heartbeat while we were down: until this time (set by
        # ``hold`` when the coordinator serves again) no node is declared lost and no lease expires.
        self._hold_until = 0.0
        self._view_from = 0.0  # heartbeat replies list live trainers from then on (view_from)

    # --- joining -------------------------------------------------------------------------------

    def join(
        self, token_text: str, csr_pem: bytes, hardware: dict[str, object], peer_address: str, name: str = ""
    ) -> Joined:
        try:
            token = JoinToken.parse(token_text)
            name = check_node_name(name)
        except (JoinTokenError, MurmurError) as err:
            raise JoinRefused(str(err)) from None
        now = self.clock()
        with self.store.write():
            row = self.store.token(token.token_id)
            if row is None or not hmac.compare_digest(row["secret_hash"], secret_hash(token.secret)):
                raise JoinRefused("join token is not valid for this coordinator; ask the operator for one")
            if row["revoked"]:
                raise JoinRefused(f"join token {token.token_id} was revoked; ask the operator for a new one")
            if row["expires_at"] < now:
                raise JoinRefused(f"join token {token.token_id} has expired; ask the operator for a new one")
            if row["uses_left"] <= 0:
                raise JoinRefused(f"join token {token.token_id} is used up; ask the operator for a new one")
            run = self.store.run(row["run_id"])
            assert run is not None
            if run["state"] == "finished":
                raise JoinRefused(f"run {run['run_id']} is finished; there is nothing left to join")
            bans = identity.BanList(self.banned())
            try:
                cert_pem = self.ca.sign_csr(csr_pem, ban_list=bans)
            except identity.IdentityError as err:
                raise JoinRefused(str(err)) from None
            node_id = identity.node_id_of_certificate(cert_pem)
            self.store.use_token(token.token_id)
            self.store.upsert_node(
                node_id, run["run_id"], cert_pem.decode(), json.dumps(hardware), peer_address, now, name
            )
            self.store.event(
                "join", run_id=run["run_id"], node_id=node_id, at=now, token=token.token_id, hardware=hardware,
                **({"name": name} if name else {}),
            )
        self._nodes[node_id] = (run["run_id"], "active")
        self._seen[node_id] = (now, 0.0)
        self._starting[node_id] = now + self.settings.join_grace_s
        return Joined(node_id, run["run_id"], cert_pem, run["config_toml"])

    # --- the hot path --------------------------------------------------------------------------

    def member(self, node_id: str) -> str:
        """The run of an active member; raises for anyone else (with what to do)."""
        entry = self._nodes.get(node_id)
        if entry is None:
            raise NotMember(f"node {node_id} is not a member of any run; join with a token first")
        run_id, status = entry
        if status == "banned":
            reason = self.banned().get(node_id, "")
            raise MembershipError(f"node {node_id} is banned from run {run_id}: {reason}")
        if status == "left":
            raise NotMember(f"node {node_id} left run {run_id}; join again with a token")
        if status == "lost":
            # It came back before anyone banned it: welcome it again (its leases are gone).
            now = self.clock()
            with self.store.write():
                self.store.set_node_status(node_id, "active")
                self.store.heartbeat(node_id, now, 0.0)
                self.store.event("returned", run_id=run_id, node_id=node_id)
            self._nodes[node_id] = (run_id, "active")
            self._seen[node_id] = (now, 0.0)
        return run_id

    def heartbeat(
        self,
        node_id: str,
        tokens_per_s: float,
        peer: tuple[str, str, int, str] | None = None,
        *,
        starting: bool = False,
    ) -> str:
        """Record a heartbeat; ``peer``: (incarnation, peer address, round, state hash) of a
        trainer; ``starting``: the process opens its data plane next and heartbeats only after
        (join_grace_s until then). Touches the ledger only when the node is not plainly active,
        or restarted."""
        run_id = self.member(node_id)
        now = self.clock()
        self._seen[node_id] = (now, tokens_per_s if tokens_per_s >= 0 else 0.0)
        if starting:
            self._starting[node_id] = now + self.settings.join_grace_s
        else:
            self.started(node_id)
        self._dirty[node_id] = None  # a node already waiting keeps its place
        if peer is not None and peer[0]:
            incarnation, address, round_id, state_hash = peer
            if self.trainers.update(node_id, run_id, incarnation[:64], address[:200], round_id, state_hash[:128]):
                with self.store.write():
                    self.store.event("restarted", run_id=run_id, node_id=node_id, incarnation=incarnation[:64])
        return run_id

    def started(self, node_id: str) -> None:
        """The node heartbeats or asks for a lease: the TTL alone decides its liveness from now on
        (its join grace ends). Not on any call: a starting node's reachability check comes
        before the start of its DHT."""
        self._starting.pop(node_id, None)

    def status(self, node_id: str) -> tuple[str, str] | None:
        """(run id, status) of a node this coordinator knows, else None."""
        return self._nodes.get(node_id)

    def is_live(self, node_id: str) -> bool:
        entry = self._nodes.get(node_id)
        return node_id in self._seen and entry is not None and entry[1] == "active"

    def grant_read(self, run_id: str, csr_pem: bytes) -> ReadGrant:
        """A reader's certificate and the live nodes holding the run's newest state
        (protocol/state_vote.py, as a joiner's fetch chooses it). Peers admit any unbanned
        certificate of the run's CA."""
        holders = [
            (n, t) for n, t in self.live_trainers(run_id)
            if t.round >= 0 and t.state_hash and t.peer_address and not is_client(t.peer_address)
        ]
        if not holders:
            last = self.store.last_round(run_id)
            if last is None:  # truly nothing yet: the run has not completed a round
                raise NoStateYet(
                    f"no live node of run {run_id} serves a state yet (nodes publish one after their first "
                    "round); try again once the run has trained a round"
                )
            # The run trained rounds, but every node that held its state is gone: waiting for a
            # round would not help, a node that serves it would.
            raise NoStateYet(
                f"run {run_id} trained to round {int(last['outer_step'])} but no live node serves its state "
                "now: start a node of the run (it resumes from its state folder), or export a node's "
                "state folder itself (murmur export STATE_DIR --out DIR)"
            )
        newest, digest = agreed_state((t.round, t.state_hash) for _, t in holders)
        cert_pem = self.reader_certificate(csr_pem)
        with self.store.write():
            self.store.event(
                "state_read", run_id=run_id, round=newest, state_hash=digest,
                reader=identity.node_id_of_certificate(cert_pem),
            )
        chosen = [(n, t) for n, t in holders if t.round == newest and t.state_hash == digest]
        return ReadGrant(cert_pem, newest, digest, chosen)

    def reader_certificate(self, csr_pem: bytes) -> bytes:
        """A reader's short-lived certificate (no member: peers and the coordinator serve it GetState)."""
        try:
            bans = identity.BanList(self.banned())
            return self.ca.sign_csr(csr_pem, validity=READER_CERT_VALIDITY, ban_list=bans)
        except identity.IdentityError as err:
            raise MembershipError(str(err)) from None

    def live_trainers(self, run_id: str) -> list[tuple[str, Trainer]]:
        """The run's trainers with a heartbeat within the TTL, by node id."""
        return self.trainers.live(run_id, self.is_live)

    def check_round(self, run_id: str, node_id: str, round_id: int, members: list[str]) -> None:
        """A commit's round group must not be a split (coordinator/trainers.py); SplitRound if it is."""
        self.trainers.check_round(run_id, node_id, round_id, members, self.is_live)

    def claim_round(self, run_id: str, round_id: int, key: str, members: list[str], run_round: int = 0) -> bool:
        """May this group apply its result of exchange call (round, key)? True granted, False
        undecided (a view not whole yet), SplitRound refused (coordinator/trainers.py)."""
        return self.trainers.claim(
            run_id, round_id, key, members, self.is_live, whole=self.view_is_whole(), run_round=run_round
        )

    def claim_lost_rounds(self, run_id: str, round_id: int, node_id: str) -> None:
        """May the node number its own state as ``round_id`` (coordinator/trainers.py)? SplitRound
        if another live process was granted that round's number."""
        self.trainers.claim_lost_rounds(run_id, round_id, node_id, self.is_live)

    def pending_count(self) -> int:
        return len(self._dirty)

    def last_seen(self, node_id: str) -> float | None:
        entry = self._seen.get(node_id)
        return entry[0] if entry else None

    def peer_address(self, node_id: str) -> str:
        """Where the node takes part in rounds from, per its latest heartbeat ("" if unknown)."""
        return self.trainers.address(node_id)

    def tokens_per_s(self, node_id: str) -> float | None:
        entry = self._seen.get(node_id)
        return entry[1] if entry else None

    def flush(self, limit: int | None = None) -> int:
        """Write the heartbeats received since they were last written (and the leases they renew)
        to the ledger: every one, or the ``limit`` that waited longest."""
        if not self._dirty:
            return 0
        if limit is None or limit >= len(self._dirty):
            nodes, self._dirty = list(self._dirty), {}
        else:
            nodes = list(itertools.islice(self._dirty, limit))
            for node_id in nodes:
                del self._dirty[node_id]
        rows = [(node_id, *self._seen[node_id]) for node_id in nodes if node_id in self._seen]
        with self.store.write():
            self.store.heartbeats(rows, self.settings.lease_ttl_s)
        return len(rows)

    def flush_due(self) -> int:
        """The sweep's share of the heartbeats to write: the part of ``heartbeat_flush_s`` that
        passed since the last sweep wrote, of the nodes waiting, longest-waiting first. Written all
        at once every ``heartbeat_flush_s``, 10,000 nodes' heartbeats (and the leases they renew)
        were one write that held the loop for 150 ms on the shared build machine, every heartbeat
        arriving meanwhile waiting behind it; a sweep every 0.5 s writes a tenth, and each node's
        row is still at most about ``heartbeat_flush_s`` old."""
        now = self.clock()
        share = min(1.0, (now - self._flushed_at) / self.settings.heartbeat_flush_s)
        limit = len(self._dirty) if share >= 1.0 else int(share * len(self._dirty))
        if limit <= 0:  # too few waiting for a share yet: they add up until the next sweeps
            return 0
        self._flushed_at = now
        return self.flush(limit)

    def hold(self, until: float) -> None:
        """Declare nobody lost and expire no lease before ``until`` (the restart grace period)."""
        self._hold_until = until

    def view_from(self, at: float) -> None:
        """List live trainers in heartbeat replies only from ``at`` on: a coordinator that just
        started has heard from some of the live trainers only, and a partial list would tell each
        of them that the others are gone (a split). One heartbeat TTL after it serves, every live
        trainer has been heard from."""
        self._view_from = at

    def view_is_whole(self) -> bool:
        return self.clock() >= self._view_from

    def sweep(self) -> tuple[list[str], int]:
        """Mark silent nodes lost (their leases go back), expire stale leases, flush now and then."""
        now = self.clock()
        self.flush_due()
        if now < self._hold_until:
            return [], 0
        deadline = now - self.settings.heartbeat_ttl_s
        silent = [n for n, (at, _) in self._seen.items() if at < deadline and self._starting.get(n, 0.0) < now]
        for node_id in silent:
            self._lose(node_id, now, reason="heartbeat_ttl")
        expired = self.leases.expire()
        return silent, len(expired)

    def lose_refused(self, node_id: str, incarnation: str, address: str, reported_by: str) -> bool:
        """A trainer whose registered peer address refused the coordinator's own connect (a peer
        reported it: coordinator/gone.py) is lost now, as the TTL would lose it later; only while
        it is still live at that address under that incarnation (a heartbeat since the dial may
        have brought a new process). True if it was marked lost."""
        t = self.trainers.get(node_id)
        if not self.is_live(node_id) or t is None or (t.incarnation, t.peer_address) != (incarnation, address):
            return False
        self._lose(node_id, self.clock(), reason="refused", address=address, reported_by=reported_by)
        return True

    def _lose(self, node_id: str, now: float, **why: object) -> None:
        """Mark an active node lost (the TTL's sweep, or a refused connect): its heartbeats and its
        trainer entry stop counting at once, its leases go back (``lease_expired``), and the
        ledger says why (a ``lost`` event with ``reason``)."""
        at, tps = self._untrack(node_id)
        run_id = self._nodes.get(node_id, ("", ""))[0]
        with self.store.write():
            self.store.heartbeats([(node_id, at, tps)], self.settings.lease_ttl_s)
            self.store.set_node_status(node_id, "lost")
            self.store.event("lost", run_id=run_id, node_id=node_id, at=now, silent_s=round(now - at, 3), **why)
            self.leases.drop_all(node_id, "lease_expired")
        self._nodes[node_id] = (run_id, "lost")

    # --- leaving and bans ----------------------------------------------------------------------

    def _untrack(self, node_id: str) -> tuple[float, float] | None:
        """Stop tracking a node's heartbeats, start grace and trainer entry; its last (heartbeat
        time, tokens/s), if it was tracked."""
        self._starting.pop(node_id, None)
        self._dirty.pop(node_id, None)
        self.trainers.drop(node_id)
        return self._seen.pop(node_id, None)

    def _forget(self, node_id: str) -> None:
        """Stop tracking a node's heartbeats (it left or was banned); store the last one first."""
        entry = self._untrack(node_id)
        if entry is not None:
            with self.store.write():
                self.store.heartbeat(node_id, *entry)

    def leave(self, node_id: str, reason: str) -> int:
        run_id = self.member(node_id)
        self._forget(node_id)
        with self.store.write():
            released = self.leases.drop_all(node_id, "lease_released")
            self.store.set_node_status(node_id, "left")
            self.store.event("leave", run_id=run_id, node_id=node_id, reason=reason[:200])
        self._nodes[node_id] = (run_id, "left")
        return released

    def ban(self, node_id: str, reason: str) -> None:
        row = self.store.node(node_id)
        if row is None:
            raise NotMember(f"no node {node_id}; `murmur admin nodes list` shows the ids")
        self._forget(node_id)
        with self.store.write():
            self.leases.drop_all(node_id, "lease_released")
            self.store.set_node_status(node_id, "banned", reason or "banned by the run's admin")
            self.store.bump("ban_version")
            self.store.event("ban", run_id=row["run_id"], node_id=node_id, reason=reason)
        self._nodes[node_id] = (row["run_id"], "banned")
        self.ban_version = self.store.counter("ban_version")

    def unban(self, node_id: str) -> None:
        row = self.store.node(node_id)
        if row is None:
            raise NotMember(f"no node {node_id}; `murmur admin nodes list` shows the ids")
        if row["status"] != "banned":
            raise MembershipError(f"node {node_id} is not banned (it is {row['status']})")
        with self.store.write():
            # Unbanned nodes come back as "left": they rejoin with a token like anyone else.
            self.store.set_node_status(node_id, "left", "")
            self.store.bump("ban_version")
            self.store.event("unban", run_id=row["run_id"], node_id=node_id)
        self._nodes[node_id] = (row["run_id"], "left")
        self.ban_version = self.store.counter("ban_version")

    def ban_list(self) -> tuple[int, list[str]]:
        return self.store.counter("ban_version"), sorted(self.store.banned())

    def banned(self) -> dict[str, str]:
        """The ban list (node id -> reason), read from the ledger once per ban-list version. Every
        join and every node's first heartbeat reply need it, and reading it scans every node's
        row: per call, 10,000 joins were 10,000 such scans (a join storm slowing as it grows)."""
        if self._banned[0] != self.ban_version:
            self._banned = (self.ban_version, self.store.banned())
        return self._banned[1]
