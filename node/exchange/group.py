"""Who takes part in a round: the group providers the gRPC exchange asks before each call.

``StaticGroup`` is a fixed {node id: address} map (tests, benchmarks, a fixed cluster).
``DHTGroup`` meets the other peers through the DHT rendezvous of protocol/dht.py: each peer
puts itself under the round's key and reads it back until ``expected`` peers are there or the
rendezvous deadline passes. Peers that saw different member lists converge inside the exchange
(an attempt's owners answer with their lists; see node/exchange/grpc_exchange.py).

A ``DHTGroup`` with a ``view`` (the coordinator's live trainers: node/daemon/run_view.py) checks
the DHT against it: rendezvous entries of dead incarnations are left out, the rendezvous waits
for the live trainers only, and the exchange's quorum is a strict majority of the live trainers
(``quorum_base``), not of whoever met at the rendezvous. The exchange tells the group when a
member's address refuses a connection (``saw_refusal``), so that entry stops counting at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from murmur.node.exchange.calls import CONNECTION_REFUSED
from murmur.node.exchange.start_floor import StartFloor
from murmur.protocol.reachability import refuses_connections


class GroupProvider(Protocol):
    async def members(self, round_id: int, key: str) -> dict[str, str]: ...


class LiveView(Protocol):
    """The run's live trainers from a source that survives churn (the coordinator)."""

    incarnation: str

    def quorum_base(self, announced: Collection[str] = ()) -> int | None: ...

    def expected(self) -> int | None: ...

    def run_round(self) -> int: ...

    def keeps(self, node_id: str, entry: dict) -> bool: ...

    def saw_refusal(self, node_id: str, address: str, reason: str) -> bool: ...

    def missing(self, present: Collection[str]) -> list[tuple[str, str]]: ...


class RoundGate(Protocol):
    """The run's arbiter of which group's result a round applies (the coordinator's ClaimRound,
    through the node's session). A peer asks it after its call completed (or caught up) and
    before it applies, serves or announces the result: returning grants it; ExchangeError (with
    the reason) refuses it, as a split of the run. A gate that cannot be asked (an outage)
    returns: the exchange's own quorum rules decide then."""

    async def claim(self, round_id: int, key: str, members: list[str]) -> None: ...


class StaticGroup:
    def __init__(self, peers: Mapping[str, str]) -> None:
        self.peers = dict(peers)

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        return dict(sorted(self.peers.items()))


REGROUP_WAIT_S = 1.0  # a regroup's look at the rendezvous: the live trainers, or what is there by then
PROBE_AFTER_S = 1.0  # a rendezvous waits this long before it dials the trainers still missing
PROBE_EVERY_S = 1.0  # then each one's address at most this often
PROBES_PER_POLL = 4  # blocking dials per rendezvous poll (a refusal is instant; a silent host costs more)


@dataclass(kw_only=True, slots=True)
class RendezvousSettings:
    deadline: float = 30.0  # seconds a peer waits at the rendezvous for the others
    min_members: int = 1  # fewer by the deadline: the round fails


class DHTGroup:
    """Round membership from the DHT (``dht`` is a started protocol.dht.MurmurDHT)."""

    def __init__(
        self,
        dht,
        address: str,
        *,
        expected: int | Callable[[], int | None] | None = None,
        announced_ids: Callable[[], Collection[str]] | None = None,
        settings: RendezvousSettings | None = None,
        view: LiveView | None = None,
        floor: StartFloor | None = None,
    ) -> None:
        self.dht = dht
        self.address = address
        self.expected = expected
        # The trainers' node ids in the DHT: the view counts those it never listed (they started
        # after the coordinator's last word, or their first heartbeat as trainers is on its way).
        self.announced_ids = announced_ids or (lambda: ())
        self.settings = settings or RendezvousSettings()
        self.view = view
        self.floor = floor  # the peers this node's start waited for: its first round waits for them too
        self._probed: dict[str, float] = {}  # node id -> when its address was last dialed

    def _expected(self) -> int | None:
        live = self.view.expected() if self.view is not None else None
        if live is None:
            live = self.expected() if callable(self.expected) else self.expected
        return live if live is None else max(live, self.fewest())

    def fewest(self) -> int:
        """The fewest members a round of the whole run may start with (node/exchange/start_floor.py)."""
        return self.floor.need() if self.floor is not None else 1

    async def members(
        self,
        round_id: int,
        key: str,
        wait_s: float | None = None,
        expected: int | Callable[[], int | None] | None = None,
        waiting: Callable[[dict[str, str]], None] | None = None,
    ) -> dict[str, str]:
        """The round's members: waits up to the rendezvous deadline (or ``wait_s``) for the others
        (``expected`` of them when given: a group's call, node/exchange/hierarchy.py, which also
        brings its own ``waiting``: it probes the group's missing members, not the run's)."""
        view = self.view
        if waiting is None and view is not None:
            waiting = functools.partial(self._probe_missing, since=time.monotonic())
        found = await self.dht.arendezvous(
            round_id,
            key,
            self.address,
            deadline=time.monotonic() + (self.settings.deadline if wait_s is None else wait_s),
            expected=self._expected if expected is None else expected,
            min_members=self.settings.min_members,
            extra={"incarnation": view.incarnation} if view is not None else None,
            keep=view.keeps if view is not None else None,
            waiting=waiting,
        )
        if expected is None and self.floor is not None:  # the whole run's call, not a group's
            self.floor.met(len(found))
        return found

    def _probe_missing(self, present: dict[str, str], since: float) -> None:
        """While the rendezvous waits (a DHT worker thread): a live trainer that has not arrived may
        be dead already, killed before it announced this round, while the coordinator has not said
        so yet (one heartbeat TTL: 10 s by default, and the round waited all of it). Its address
        refusing a connect proves it: the view drops it, and the expected count with it. Only past
        PROBE_AFTER_S: the live ones mostly arrive within it, and every dial is a connection."""
        assert self.view is not None
        now = time.monotonic()
        if now - since < PROBE_AFTER_S:
            return
        due = [(n, a) for n, a in self.view.missing(present)
               if now - self._probed.get(n, -PROBE_EVERY_S) >= PROBE_EVERY_S]
        for node_id, address in due[:PROBES_PER_POLL]:
            self._probed[node_id] = now
            if refuses_connections(address):
                self.view.saw_refusal(node_id, address, f"{CONNECTION_REFUSED} while the rendezvous waited for it")

    async def current(self, round_id: int, key: str) -> dict[str, str]:
        """Who is at the round's rendezvous now (a regroup mid-call: waiting the whole rendezvous
        deadline there would leave this peer's attempts unserved, and the others drop it)."""
        return await self.members(round_id, key, wait_s=REGROUP_WAIT_S)

    async def present(self, round_id: int, key: str) -> dict[str, str]:
        """Who is at a round's rendezvous now, without joining it (node/exchange/hierarchy.py
        looks there for the holders of a column result it missed)."""
        return await self.dht.around_entries(round_id, key)

    async def leave(self, round_id: int, key: str) -> None:
        """This peer's call of the round failed: its rendezvous entry must not count for the retry."""
        await self.dht.aleave_round(round_id, key)

    # -- what the exchange asks of a group that knows the live trainers ---------------------------

    def quorum_base(self) -> int | None:
        """A round group must be a strict majority of this many (None: the view is not fresh)."""
        return self.view.quorum_base(self.announced_ids()) if self.view is not None else None

    def announced(self) -> int | None:
        """How many trainers the DHT holds records of, this one included (None: unknown). Without
        a fresh view (a coordinator that just started or is down), a round group must be a strict
        majority of these too: a peer whose rendezvous saw only itself must not complete alone."""
        return self.expected() if callable(self.expected) else self.expected

    def behind(self, round_id: int) -> int | None:
        """The run's round when live trainers completed ``round_id`` already (the newest round
        one of them reports), else None: with nobody to catch up from, this peer must re-sync."""
        if self.view is None:
            return None
        newest = self.view.run_round()
        return newest if newest > round_id else None

    def saw_refusal(self, node_id: str, address: str, reason: str) -> bool:
        return self.view.saw_refusal(node_id, address, reason) if self.view is not None else False
