"""Shard leases and progress accounting: every token of the dataset is counted exactly once.

Rules (each enforced inside one write transaction, so a crash leaves either all or none of it):
* a shard has at most one holder, named by a fresh lease id each time it is leased; a node holds
  one lease to train on, plus those it named exhausted (no full batch left) while it trains the
  window that ends them: they are committed with that window's round;
* a lease lives until it expires (no renewal for ``lease_ttl_s``; heartbeats renew), is released,
  or its shard is done; then the shard goes back to the pool from its last committed offset;
* a commit names its lease and the span ``[start, end)`` it trained on. It is accepted only if the
  lease is still the shard's current, unexpired lease and ``start`` is the committed offset;
* a commit repeated with the same lease and end offset (a retry after a lost reply) is answered
  "duplicate" and changes nothing, which makes commits idempotent;
* a commit under a lease that was taken away is refused, so the re-leased span is counted once,
  by whoever holds it now.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from murmur.errors import MurmurError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.runconfig import ConfigError, parse_config

from .settings import CoordinatorSettings
from .store import Shard, Store

# A window runs through a few shards at most (a shard holds many windows' tokens): more exhausted
# leases held at once means a node that does not commit.
MAX_EXHAUSTED_HELD = 8


class LeaseError(MurmurError):
    """A lease call that cannot be honoured; ``code`` names the gRPC status the service maps it to."""

    code = "FAILED_PRECONDITION"


class LeaseLost(LeaseError):
    pass


class BadCommit(LeaseError):
    code = "INVALID_ARGUMENT"


class UnknownShard(LeaseError):
    code = "NOT_FOUND"


class Why(str):
    """Why no lease (the words, for logs) with its typed status (``pb.LeaseStatus``), which the
    AcquireLease reply carries and nodes decide on. A str, so callers that only log it need not care."""

    status: int

    def __new__(cls, reason: str, status: int) -> Why:
        why = super().__new__(cls, reason)
        why.status = status
        return why


GRANTED = Why("", pb.LEASE_GRANTED)


@dataclass(slots=True)
class CommitResult:
    duplicate: bool
    committed_offset: int
    shard_done: bool


@dataclass(slots=True)
class Progress:
    outer_step: int
    loss: float
    bytes_sent: int
    seconds: float
    val_loss: float | None = None  # the round's validation loss, when the node evaluated it


class Leases:
    def __init__(
        self,
        store: Store,
        settings: CoordinatorSettings,
        last_seen: Callable[[str], float | None] = lambda node_id: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        # The membership keeps fresh heartbeats in memory between flushes; a lease is alive until
        # max(stored expiry, last heartbeat + TTL).
        self.last_seen = last_seen
        self.clock = clock
        self._wanted_drivers: dict[str, int] = {}  # run -> its pipeline.drivers (0: no limit)

    def _drivers_full(self, run_id: str, config_toml: str, node_id: str, now: float) -> str | None:
        """Why a node that holds no lease of a pipelined run gets none: the run has the drivers its
        ``pipeline.drivers`` wants (the holders of its live leases). None: it may lease. This is how
        the coordinator decides the role of a volunteer that joins with ``--role auto``."""
        if run_id not in self._wanted_drivers:
            try:
                pipe = parse_config(config_toml, "the run configuration").pipeline
            except ConfigError:
                pipe = None
            self._wanted_drivers[run_id] = pipe.drivers if pipe is not None else 0
        wanted = self._wanted_drivers[run_id]
        if not wanted:
            return None
        holders = {s.holder for s in self.store.shards(run_id)
                   if s.holder and s.holder != node_id and self._expiry(s) >= now}
        if len(holders) < wanted:
            return None
        return f"the run has the {wanted} driver(s) its pipeline.drivers wants"

    def _expiry(self, shard: Shard) -> float:
        seen = self.last_seen(shard.holder) if shard.holder else None
        stored = shard.lease_expiry or 0.0
        return max(stored, seen + self.settings.lease_ttl_s) if seen is not None else stored

    def acquire(self, run_id: str, node_id: str, exhausted: frozenset[str] = frozenset()) -> tuple[Shard | None, Why]:
        """The node's lease: the one it already holds, else a free shard. (None, why) when none:
        ``why.status`` says whether the node should stop (every shard done, the run finished) or
        ask again later (every unfinished shard leased, the run paused, ...).

        Held leases named in ``exhausted`` (no full batch left; the node commits them with the
        window it is training) are not handed back: they stay held, and a free shard is granted
        beside them, at most MAX_EXHAUSTED_HELD of them."""
        run = self.store.run(run_id)
        if run is None:
            raise UnknownShard(f"run {run_id} does not exist")
        if run["state"] != "active":
            status = pb.LEASE_RUN_FINISHED if run["state"] == "finished" else pb.LEASE_RUN_PAUSED
            return None, Why(f"run {run_id} is {run['state']}", status)
        now = self.clock()
        with self.store.write():
            done_with = 0
            for held in self.store.shards_held(node_id):
                if held.run_id != run_id:
                    continue
                if held.lease_id not in exhausted:
                    return held, GRANTED
                done_with += 1
            if done_with > MAX_EXHAUSTED_HELD:
                why = f"this node holds {done_with} exhausted leases it has not committed; commit them first"
                return None, Why(why, pb.LEASE_COMMIT_FIRST)
            if (full := self._drivers_full(run_id, run["config_toml"], node_id, now)) is not None:
                return None, Why(full, pb.LEASE_DRIVERS_FULL)
            shard = self.store.free_shard(run_id)
            if shard is None:
                totals = self.store.run_totals(run_id)
                if totals["shards_done"] == totals["shards_total"]:
                    return None, Why("every shard is done", pb.LEASE_ALL_DONE)
                return None, Why("every unfinished shard is leased; ask again later", pb.LEASE_ALL_LEASED)
            lease_id = secrets.token_hex(8)
            expiry = now + self.settings.lease_ttl_s
            self.store.set_lease(run_id, shard.shard_id, node_id, lease_id, expiry)
            self.store.bump("leases_granted")
            self.store.event(
                "lease_granted",
                run_id=run_id,
                node_id=node_id,
                at=now,
                shard=shard.shard_id,
                lease=lease_id,
                offset=shard.committed_offset,
            )
            shard.holder, shard.lease_id, shard.lease_expiry = node_id, lease_id, expiry
        return shard, GRANTED

    def commit(
        self,
        run_id: str,
        node_id: str,
        lease_id: str,
        shard_id: int,
        start: int,
        end: int,
        progress: Progress,
    ) -> CommitResult:
        if not math.isfinite(progress.loss):
            raise BadCommit(f"loss must be a finite number, got {progress.loss}")
        if progress.val_loss is not None and not math.isfinite(progress.val_loss):
            raise BadCommit(f"val_loss must be a finite number, got {progress.val_loss}")
        if progress.bytes_sent < 0 or progress.seconds < 0 or progress.outer_step < 0:
            raise BadCommit("outer_step, bytes_sent and seconds must not be negative")
        now = self.clock()
        with self._recording_refusal(run_id, node_id, shard_id), self.store.write():
            done = self.store.commit_record(lease_id, end)
            if done is not None:
                if (done["node_id"], done["shard_id"], done["start_offset"]) != (node_id, shard_id, start):
                    raise BadCommit(f"lease {lease_id} already committed a different span ending at {end}")
                shard = self.store.shard(run_id, shard_id)
                assert shard is not None
                return CommitResult(True, shard.committed_offset, shard.done)
            shard = self.store.shard(run_id, shard_id)
            if shard is None:
                raise UnknownShard(f"run {run_id} has no shard {shard_id}")
            if shard.lease_id != lease_id or shard.holder != node_id:
                raise LeaseLost(
                    f"lease {lease_id} on shard {shard_id} is no longer yours (it expired or was released); "
                    "drop this work and acquire a new lease"
                )
            if self._expiry(shard) < now:
                raise LeaseLost(f"lease {lease_id} on shard {shard_id} expired; acquire a new lease")
            if start != shard.committed_offset:
                raise BadCommit(
                    f"commit starts at offset {start} but shard {shard_id} is committed up to "
                    f"{shard.committed_offset}; train from the committed offset"
                )
            if not start < end <= shard.tokens:
                raise BadCommit(f"commit end {end} must be within ({start}, {shard.tokens}]")
            self.store.insert_commit(
                lease_id=lease_id,
                end_offset=end,
                run_id=run_id,
                shard_id=shard_id,
                node_id=node_id,
                start_offset=start,
                outer_step=progress.outer_step,
                loss=progress.loss,
                bytes_sent=progress.bytes_sent,
                seconds=progress.seconds,
                at=now,
                val_loss=progress.val_loss,
            )
            finished = end == shard.tokens
            self.store.advance(shard, end, finished)
            self.store.bump("tokens_committed", end - start)
            self.store.bump("commits")
            if finished:
                self.store.clear_lease(run_id, shard_id)
                self.store.bump("leases_released")
                self.store.event("shard_done", run_id=run_id, node_id=node_id, at=now, shard=shard_id)
            else:
                # A commit is a sign of life: it renews the lease like a heartbeat.
                self.store.set_lease(run_id, shard_id, node_id, lease_id, now + self.settings.lease_ttl_s)
        return CommitResult(False, end, finished)

    @contextmanager
    def _recording_refusal(self, run_id: str, node_id: str, shard_id: int) -> Iterator[None]:
        """A refused commit rolls its transaction back; count it (and name the node) in one of its own."""
        try:
            yield
        except LeaseLost:
            with self.store.write():
                self.store.bump("commits_refused")
                self.store.event("commit_refused", run_id=run_id, node_id=node_id, shard=shard_id)
            raise

    def release(self, node_id: str, lease_id: str) -> int:
        with self.store.write():
            for shard in self.store.shards_held(node_id):
                if shard.lease_id == lease_id:
                    self._drop(shard, "lease_released")
                    return shard.committed_offset
        raise LeaseLost(f"lease {lease_id} is not held by node {node_id}; nothing to release")

    def drop_all(self, node_id: str, kind: str) -> int:
        """Give back every lease of a node (it left, was lost or banned); returns how many."""
        with self.store.write():
            held = self.store.shards_held(node_id)
            for shard in held:
                self._drop(shard, kind)
        return len(held)

    def expire(self) -> list[Shard]:
        """Take back every lease past its expiry (called by the sweeper after it flushes heartbeats)."""
        now = self.clock()
        expired = [s for s in self.store.expired_leases(now) if self._expiry(s) < now]
        if expired:
            with self.store.write():
                for shard in expired:
                    self._drop(shard, "lease_expired")
        return expired

    def _drop(self, shard: Shard, kind: str) -> None:
        self.store.clear_lease(shard.run_id, shard.shard_id)
        self.store.bump("leases_released" if kind == "lease_released" else "leases_expired")
        self.store.event(
            kind,
            run_id=shard.run_id,
            node_id=shard.holder or "",
            shard=shard.shard_id,
            lease=shard.lease_id,
            offset=shard.committed_offset,
        )
