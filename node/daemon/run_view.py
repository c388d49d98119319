"""The run's live trainers as the coordinator last said, and the peers this node saw die.

Every heartbeat reply lists the run's live trainers: node id, incarnation (random per process
start), peer address, last round and state hash (coordinator/trainers.py). `RunView` keeps the
latest list; the data plane checks the DHT against it (node/exchange/group.py, node/daemon/
peer_dataplane.py):

* a round group must be a strict majority of the live trainers (``quorum_base``), so a node that
  cannot see the others never completes a round alone, and two halves can never both go on;
* a rendezvous entry is dead (``keeps`` says no) when its incarnation is not the live one, when
  its node was live and no longer is (lost, left), or when its address refused a connection: the
  round goes on without it at once instead of waiting for the entry's TTL;
* a joiner that sees no peer record takes the state from the trainers listed here.

Each newly seen death is also queued for the coordinator (``take_gone``; the session sends it
with ReportGone at once): the coordinator dials the peer itself and, if it is refused too, lists
it as lost right away, so the quorum of the survivors is counted without it instead of after the
heartbeat TTL (coordinator/gone.py).

The view is only trusted while fresh (a few heartbeats old): through a coordinator outage the
data plane falls back on what the DHT alone shows.

Thread safety: updated on the daemon's loop; read from the DHT's worker threads (plain lookups).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from murmur.node.exchange.calls import process_gone
from murmur.protocol import coordinator_pb2 as pb


def new_incarnation() -> str:
    return secrets.token_hex(8)


@dataclass(slots=True, frozen=True)
class ViewMember:
    node_id: str
    incarnation: str
    address: str
    round: int
    state_hash: str


class RunView:
    def __init__(self, node_id: str, incarnation: str, fresh_s: float) -> None:
        self.node_id, self.incarnation, self.fresh_s = node_id, incarnation, fresh_s
        self.members: dict[str, ViewMember] = {}
        self.updated_at = -float("inf")  # time.monotonic() of the last reply
        self.newest = -1  # the newest round any trainer reported (live or not since)
        self._ever: set[str] = set()  # nodes some view listed: absent from a fresh one = gone
        self._dead: set[tuple[str, str]] = set()  # (node id, address) that refused a connection
        # Deaths not yet reported to the coordinator, and who to wake when one is queued (the
        # session: saw_refusal is called on the loop and from the DHT's worker threads).
        self._gone: list[tuple[str, str]] = []
        self._gone_lock = threading.Lock()
        self.on_gone: Callable[[], None] | None = None

    def update(self, members: Iterable[pb.LiveMember], newest: int = -1) -> None:
        self.newest = max(self.newest, newest)
        fresh = {
            m.node_id: ViewMember(m.node_id, m.incarnation, m.peer_address, int(m.round), m.state_hash)
            for m in members
        }
        for node_id, m in fresh.items():
            old = self.members.get(node_id)
            if old is not None and old.incarnation != m.incarnation:  # restarted: a new process
                with self._gone_lock:
                    self._dead = {d for d in self._dead if d[0] != node_id or d[1] != m.address}
        self.members = fresh
        self._ever |= set(fresh)
        self.updated_at = time.monotonic()

    def fresh(self) -> bool:
        return time.monotonic() - self.updated_at <= self.fresh_s

    def trainers(self) -> list[ViewMember]:
        """Live trainers in rounds (they report a peer address), this node included, when fresh."""
        if not self.fresh():
            return []
        return [m for m in self.members.values() if m.address]

    # -- what the exchange's group asks ----------------------------------------------------------

    def newcomers(self, announced: Collection[str]) -> set[str]:
        """Trainers the DHT announces that no view has listed yet and none was seen dead: they
        train already, and the coordinator's word on them is on its way (a trainer's heartbeat
        names its peer address only after its first round). A node that was listed and is no
        longer is gone, not new."""
        dead = {node_id for node_id, _ in self._dead}
        return {n for n in announced if n != self.node_id and n not in self._ever and n not in dead}

    def quorum_base(self, announced: Collection[str] = ()) -> int | None:
        """How many trainers a round group must be a strict majority of; None when not fresh.
        The live trainers and the newcomers: early in a run, a fast node whose view listed only
        itself completed rounds alone while a slower one trained (its first heartbeat as a
        trainer not yet in), and the two trained apart from then on."""
        if not self.fresh():
            return None
        return len({m.node_id for m in self.trainers()} | {self.node_id} | self.newcomers(announced))

    def round_trainers(self, announced: Collection[str] = ()) -> set[str]:
        """The trainers a grouped round's groups are formed from (node/exchange/groups.py; empty
        when not fresh): those the quorum counts (the live trainers, this node, the newcomers) and
        the trainers the DHT announces that the view lists without a peer address yet. A node
        names its address in its heartbeats only once it holds a state, so early in a run one
        node's view listed two trainers of four while the others' listed four: it formed one
        group, they formed two under other keys, and the round waited out its deadline. Not those
        seen dead: a group would wait for them at its rendezvous."""
        if not self.fresh():
            return set()
        late = {n for n in announced if n in self.members} - {node_id for node_id, _ in self._dead}
        return {m.node_id for m in self._alive()} | {self.node_id} | self.newcomers(announced) | late

    def expected(self) -> int | None:
        """How many members a rendezvous waits for: the live trainers not seen dead. Not the
        newcomers: one still loading the state would hold every round to the rendezvous
        deadline; a round without it goes on if it has quorum, and meets again if not."""
        if not self.fresh():
            return None
        return len({m.node_id for m in self._alive()} | {self.node_id})

    def nobody_ahead(self, min_round: int) -> bool:
        """Fresh, listing no live trainer but this node, and no trainer ever reported a round at or
        past ``min_round``: nobody serves a newer state or is about to (a node is listed once it
        holds a state)."""
        if not self.fresh() or self.newest >= min_round:
            return False
        return all(m.node_id == self.node_id for m in self.trainers())

    def run_round(self) -> int:
        """The newest round a live trainer reports (-1 when none or not fresh)."""
        return max((m.round for m in self.trainers() if m.node_id != self.node_id), default=-1)

    def keeps(self, node_id: str, entry: dict) -> bool:
        """Whether a rendezvous entry (``address``, ``incarnation``) may be a live member."""
        if node_id == self.node_id:
            return entry.get("incarnation", self.incarnation) == self.incarnation
        if (node_id, str(entry.get("address", ""))) in self._dead:
            return False
        if not self.fresh():
            return True
        m = self.members.get(node_id)
        if m is None:
            return node_id not in self._ever  # never listed yet: a newcomer, not a dead one
        inc = entry.get("incarnation")
        return not inc or inc == m.incarnation

    def missing(self, present: Collection[str]) -> list[tuple[str, str]]:
        """(node id, address) of the live trainers, not seen dead, that are not among ``present``
        (a rendezvous's arrivals): the ones it still waits for."""
        return [(m.node_id, m.address) for m in self._alive() if m.node_id != self.node_id and m.node_id not in present]

    def _alive(self) -> list[ViewMember]:
        """The live trainers whose address has not refused a connection."""
        return [m for m in self.trainers() if (m.node_id, m.address) not in self._dead]

    def dead_ids(self) -> set[str]:
        """The nodes one of whose addresses refused a connection (that process is dead)."""
        with self._gone_lock:
            return {node_id for node_id, _ in self._dead}

    def saw_refusal(self, node_id: str, address: str, reason: str) -> bool:
        """A member's address refused a connection: that process is dead. True if recorded."""
        if not process_gone(reason) or node_id == self.node_id:
            return False
        with self._gone_lock:
            new = (node_id, address) not in self._dead
            self._dead.add((node_id, address))
            if new and address:
                self._gone.append((node_id, address))
        if new and address and self.on_gone is not None:
            self.on_gone()
        return True

    def take_gone(self) -> list[tuple[str, str]]:
        """(node id, address) of the deaths seen since the last call, for ReportGone."""
        with self._gone_lock:
            gone, self._gone = self._gone, []
        return gone
