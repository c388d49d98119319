"""Peers a member reports dead: the coordinator dials each itself and loses the dead ones at once.

A node learns a peer is dead as soon as a TCP connect to the peer's address is refused: the
kernel closes a dead process's listening socket (SIGKILL included), so the refusal comes at once
(protocol/reachability.py). The coordinator would learn it only when the peer's heartbeats stop
for ``heartbeat_ttl_s``, and until then it lists the peer as a live trainer: a round group of the
survivors that is not a strict majority of that list is refused (ClaimRound), and the survivors'
own quorum counts it too. So with 2 of 4 trainers killed, the other two waited out the TTL.

``ReportGone`` closes that gap. A member names the peers whose address refused it; for each one
that the coordinator lists as a live trainer at that very address, it makes a connect of its own
to the address the peer itself registered (its heartbeats: a reporter cannot point the
coordinator anywhere else), off the event loop, and only when that connect is refused it marks
the trainer lost through the same path as a TTL expiry (membership.py: a ``lost`` event, here
with ``reason`` "refused", its leases back to the pool). The reporter is trusted for nothing:

* a process that accepts connections (alive, or hung) is never marked: only a refusal is a death,
  a timeout or an accepted connect changes nothing (a silent hung one is lost by its TTL);
* only members may report (mutual TLS, the caller's certificate names it, as for every member
  call), and only peers of their own run; unknown, left, banned or already lost peers are a no-op;
* each peer is dialed at most once per ``gone_dial_every_s`` whoever reports it (reports that
  come while a dial is under way share its answer), so reports cannot make the coordinator a
  connect flood: the dials per second are bounded by the run's live trainers;
* a peer whose incarnation or address changed while it was dialed (it restarted) is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from murmur.protocol.reachability import arefuses_connections, is_client

from .membership import Membership

MAX_GONE_PER_REPORT = 64  # peers one ReportGone may name (a run's dead trainers of one round)
DIALED_KEPT = 4096  # per-peer dial times kept before the stale ones are pruned


class GoneReports:
    def __init__(
        self,
        membership: Membership,
        dial_every_s: float,
        *,
        refused: Callable[[str], Awaitable[bool]] = arefuses_connections,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.membership = membership
        self.dial_every_s = dial_every_s
        self.refused = refused
        self.clock = clock
        self.dials = 0  # connects made so far (tests and metrics)
        self._dialed: dict[str, float] = {}  # node id -> when its address was last dialed
        self._checks: dict[str, asyncio.Task[bool]] = {}  # node id -> the dial under way

    async def verify(self, reporter: str, run_id: str, peers: list[tuple[str, str]]) -> list[str]:
        """Dial the reported (node id, address) pairs that are live trainers of ``run_id`` at that
        address, and lose those whose connect is refused. Returns the reported peers the
        coordinator holds lost after this (marked now, or lost before), in report order."""
        lost: list[str] = []
        checks: dict[str, Awaitable[bool]] = {}
        for node_id, address in dict(peers).items():
            known = self.membership.status(node_id)
            if known is None or known[0] != run_id or node_id == reporter:
                continue
            if known[1] == "lost":
                lost.append(node_id)
                continue
            t = self.membership.trainers.get(node_id)
            if (
                t is None
                or t.run_id != run_id
                or not address
                or t.peer_address != address
                or is_client(address)
                or not self.membership.is_live(node_id)
            ):
                continue
            check = self._check(node_id, t.incarnation, address, reporter)
            if check is not None:
                checks[node_id] = check
        if checks:
            verdicts = await asyncio.gather(*checks.values())
            lost += [n for n, dead in zip(checks, verdicts, strict=True) if dead]
        return lost

    def _check(self, node_id: str, incarnation: str, address: str, reporter: str) -> Awaitable[bool] | None:
        """The verdict on one peer: the dial under way, a new one, or None (dialed too recently)."""
        running = self._checks.get(node_id)
        if running is not None:
            return asyncio.shield(running)
        now = self.clock()
        if now - self._dialed.get(node_id, -float("inf")) < self.dial_every_s:
            return None
        self._dialed[node_id] = now
        if len(self._dialed) > DIALED_KEPT:
            self._dialed = {n: at for n, at in self._dialed.items() if now - at < self.dial_every_s}
        # A task of its own: the verdict is applied even if the reporter's call is cancelled.
        task = asyncio.ensure_future(self._dial(node_id, incarnation, address, reporter))
        self._checks[node_id] = task
        task.add_done_callback(lambda _: self._checks.pop(node_id, None))
        return asyncio.shield(task)

    async def _dial(self, node_id: str, incarnation: str, address: str, reporter: str) -> bool:
        self.dials += 1
        if not await self.refused(address):
            return False
        if self.membership.lose_refused(node_id, incarnation, address, reporter):
            return True
        return (self.membership.status(node_id) or ("", ""))[1] == "lost"  # the TTL was first
