"""The run's live trainers as the coordinator sees them, and the check that keeps splits out of the ledger.

Round membership needs a source of truth that survives churn. The DHT alone is not one: a killed
node's records and rendezvous entries outlive it, and a node that cannot see the others' records
cannot tell "alone" from "late". The coordinator can: every trainer heartbeats every second with
its incarnation (random per process start), its peer address, its last round and state hash, and
a trainer silent for ``heartbeat_ttl_s`` is lost. The heartbeat reply hands each trainer this view
(node/daemon/run_view.py keeps it), and the nodes' exchange uses it: a round group must be a
strict majority of the live trainers, a rendezvous entry of an incarnation that is not the live one
is dead, and a joiner that sees no peer record fetches the state from the trainers listed here.

Before a node applies an exchange round's result it claims the round for its group (the
ClaimRound call): the first group granted a round is the run's, and a group that shares no member
with it, or is a minority of the live trainers, is refused, so two lineages of the run can never
both apply a round (a node alone from an old checkpoint, two halves that cannot see each other).
A grant remembers its members as processes (node id and incarnation), not as node ids: a member
that died after giving its input to the granted group and restarted from an older checkpoint is
another process, with another state, and a group it forms for the same round shares nothing with
the granted one. A grant also moves the run's newest round to the round the claimant's window
completes, so a node that comes back behind it, with every holder of that round gone, waits for
it and then numbers past it (node/daemon/resume.py, node/daemon/resync.py) instead of claiming it again and again.
A node that goes on numbered past rounds lost with their holders claims that too
(``claim_lost_rounds``): one process per round may, so two nodes back at once from different
checkpoints never both give their state the same round number.
The nodes' own quorum rules keep working through a coordinator outage; this check makes them
exact while it is up.

A commit names the members of the round its tokens reached the global model in. It is a split,
and refused, when that group is not a strict majority of the trainers that were live a while
before the commit (new joiners are left out, so a round completed just before they came is not
refused), or when it shares no member with the group the run completed that round with (two
groups cannot both have completed round r). Group records live in memory: after a coordinator
restart only the majority rule applies until the rounds move on, and claims are undecided until
the view is whole again (one heartbeat TTL).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .leases import LeaseLost

ROUNDS_KEPT = 4096  # rounds whose completing group is remembered, per run


class SplitRound(LeaseLost):
    """A commit of tokens that reached a split's model, not the run's. ABORTED, not
    FAILED_PRECONDITION: the node must also re-sync its state from the run, not only drop a lease."""

    code = "ABORTED"


@dataclass(slots=True)
class Trainer:
    run_id: str
    incarnation: str
    peer_address: str
    round: int
    state_hash: str
    since: float  # when this incarnation first reported a peer address (or first heartbeat)


class Trainers:
    def __init__(self, settle_s: float, clock: Callable[[], float] = time.time) -> None:
        self.settle_s = settle_s  # a trainer live for less than this is not counted against a commit
        self.clock = clock
        self._by_node: dict[str, Trainer] = {}
        self._groups: dict[str, OrderedDict[int, frozenset[str]]] = {}  # run -> round -> its commits' group
        # run -> (round, key) of an exchange call -> the group granted to apply its result
        self._claims: dict[str, OrderedDict[tuple[int, str], frozenset[str]]] = {}
        self.newest: dict[str, int] = {}  # run -> the newest round a trainer reported
        # run -> run round a grant completes -> the nodes of the groups granted it (run_round)
        self._granted: dict[str, OrderedDict[int, set[str]]] = {}
        # run -> round -> the process (node id, incarnation) granted to number its own state as
        # that round, its holders being gone (claim_lost_rounds)
        self._renumbered: dict[str, OrderedDict[int, tuple[str, str]]] = {}
        # node -> its newest incarnation that took part in rounds (reported a peer address); kept
        # after the node is lost: a grant names the process that gave its input, dead or not.
        self._in_rounds: dict[str, str] = {}
        # Bumped by every change of the live-trainer view (coordinator/trainer_view.py rebuilds from
        # them): ``changes`` when a trainer comes, goes, restarts or moves; ``progress`` when one
        # only reports a new round or state hash (every trainer, every round).
        self.changes = 0
        self.progress = 0

    def update(
        self, node_id: str, run_id: str, incarnation: str, peer_address: str, round_id: int, state_hash: str
    ) -> bool:
        """Record a trainer's heartbeat; True when it is a new incarnation of a known node."""
        self.newest[run_id] = max(self.newest.get(run_id, -1), round_id if peer_address else -1)
        if peer_address:
            self._in_rounds[node_id] = incarnation
        old = self._by_node.get(node_id)
        if old is not None and old.incarnation == incarnation:
            if peer_address and not old.peer_address:
                old.since = self.clock()  # in rounds from now on
            if old.peer_address != peer_address:
                self.changes += 1
            elif (old.round, old.state_hash) != (round_id, state_hash):
                self.progress += 1
            old.peer_address, old.round, old.state_hash = peer_address, round_id, state_hash
            return False
        self._by_node[node_id] = Trainer(run_id, incarnation, peer_address, round_id, state_hash, self.clock())
        self.changes += 1
        return old is not None

    def get(self, node_id: str) -> Trainer | None:
        """The node's latest heartbeat as a trainer (None if it has none, or is lost, left, banned)."""
        return self._by_node.get(node_id)

    def address(self, node_id: str) -> str:
        """The peer address of the node's latest heartbeat ("" if none)."""
        t = self._by_node.get(node_id)
        return t.peer_address if t is not None else ""

    def drop(self, node_id: str) -> None:
        """The node is lost, left or banned: its incarnation stops counting at once."""
        if self._by_node.pop(node_id, None) is not None:
            self.changes += 1

    def live(self, run_id: str, is_live: Callable[[str], bool]) -> list[tuple[str, Trainer]]:
        """The run's live trainers in rounds: those that hold the run's state and report the
        address they take part from (a node still starting or fetching the state has none yet)."""
        return sorted(
            ((n, t) for n, t in self._by_node.items() if t.run_id == run_id and t.peer_address and is_live(n)),
            key=lambda nt: nt[0],
        )

    def check_round(
        self, run_id: str, node_id: str, round_id: int, members: list[str], is_live: Callable[[str], bool]
    ) -> None:
        """Refuse (SplitRound) a commit whose round group is a split; remember the run's group."""
        group = frozenset(members)
        if node_id not in group:
            raise SplitRound(
                f"{node_id} is not in the group that completed round {round_id} (its update was left out "
                "and it caught up): these tokens never reached the model; train them again"
            )
        # A round the run granted to this group (ClaimRound, before anyone applied it) was judged
        # then, against the trainers live then: its commits come a checkpoint later, and a node
        # that joined meanwhile must not turn it into a minority. A lone trainer whose checkpoint
        # was slow had every round it trained alone refused, and re-synced for nothing.
        granted = group <= self._granted.get(run_id, {}).get(round_id, set())
        self._judge(self._groups.setdefault(run_id, OrderedDict()), round_id, f"round {round_id}", run_id, group,
                    is_live, settle_s=self.settle_s, granted=granted)

    def claim(
        self,
        run_id: str,
        round_id: int,
        key: str,
        members: list[str],
        is_live: Callable[[str], bool],
        *,
        whole: bool = True,
        run_round: int = 0,
    ) -> bool:
        """Whether the group ``members`` may apply its result of exchange call (round, key): True
        granted, SplitRound refused, False undecided (``whole`` is False, a view not yet whole after
        a restart, and nobody claimed the call since: the claimant decides on its own quorum).
        ``run_round``: the run round the claimant's window completes with it (0: not said); a grant
        makes it the run's newest round."""
        claims = self._claims.setdefault(run_id, OrderedDict())
        what = f"round {round_id} {key!r}" if key else f"round {round_id}"
        if not whole and (round_id, key) not in claims:
            return False
        # Every live trainer counts, the newest too: a claim comes right after its call completed,
        # and a trainer that came in meanwhile holds the state and meets the next attempt.
        self._judge(claims, (round_id, key), what, run_id, frozenset(members), is_live, settle_s=0.0,
                    remembered=self._processes(members))
        if run_round > 0:
            granted = self._granted.setdefault(run_id, OrderedDict())
            _keep(granted, run_round, granted.get(run_round, set()) | set(members))
        return True

    def claim_lost_rounds(self, run_id: str, round_id: int, node_id: str, is_live: Callable[[str], bool]) -> None:
        """May ``node_id`` go on from its own state numbered as ``round_id``, every holder of the
        rounds past its state being gone? Granted to one process per round while it lives (the
        same process may ask again); SplitRound for any other. Two nodes back behind the run at
        once, from different checkpoints, would otherwise both number their states as that round:
        two states of one round, and every later round averaged from two bases. The one refused
        waits for the granted node's state, which the view lists as soon as it heartbeats it."""
        me = self._by_node.get(node_id)
        if me is None or me.run_id != run_id:
            raise SplitRound(f"{node_id} is not a trainer of run {run_id}: heartbeat first")
        granted = self._renumbered.setdefault(run_id, OrderedDict())
        holder = granted.get(round_id)
        if holder not in (None, self._process(node_id)) and is_live(holder[0]) and self._process(holder[0]) == holder:
            raise SplitRound(
                f"{holder[0]} goes on from its own state as round {round_id} of run {run_id} already: "
                "take its state rather than numbering another one as that round"
            )
        _keep(granted, round_id, self._process(node_id))

    def _process(self, node_id: str) -> tuple[str, str] | None:
        """The node's process as its latest heartbeat names it (None if it has none)."""
        t = self._by_node.get(node_id)
        return (node_id, t.incarnation) if t is not None else None

    def run_round(self, run_id: str, node_id: str) -> int:
        """The newest round of the run as ``node_id`` should see it: the newest a trainer reported,
        or a grant reached. Not a grant to groups of this node alone (its earlier processes): the
        node itself is back, from a checkpoint before that round, so nobody holds it and waiting
        for it would only stall a lone trainer's restart."""
        newest = self.newest.get(run_id, -1)
        for r in reversed(self._granted.get(run_id, {})):
            if r <= newest:
                break
            if self._granted[run_id][r] - {node_id}:
                return r
        return newest

    def _processes(self, members: list[str]) -> frozenset[tuple[str, str]]:
        """Each member as the process that took part in a round just completed: its newest
        incarnation that reported a peer address. A restart still starting has none yet and was
        in no round, so its predecessor is named. (A claim that arrives after a member died,
        restarted and reported its new address names the new process: a claim comes right after
        its call, and a restart takes seconds.)"""
        return frozenset((n, self._in_rounds.get(n, "")) for n in members)

    def _judge(
        self,
        groups: OrderedDict,
        at: object,
        what: str,
        run_id: str,
        group: frozenset[str],
        is_live: Callable[[str], bool],
        *,
        settle_s: float,
        remembered: frozenset | None = None,
        granted: bool = False,
    ) -> None:
        """The split rules for the group of ``at`` (a round, or an exchange call): it must share a
        member with the group the run was granted ``at`` with (compared as ``remembered``, the
        group's node ids by default); the first group must be a strict majority of the trainers
        live for ``settle_s`` or more and of its own members (a commit comes a while after its
        round: trainers newer than that may have joined after the round was completed), unless
        ``granted``: the run granted it to this group already, judged when it was claimed.
        SplitRound if not."""
        if remembered is None:
            remembered = group
        known = groups.get(at)
        if known is not None and not known & remembered and _nodes(known) <= _nodes(remembered):
            # Every member of the granted group is back as another process, in this group, and
            # claims the call again: each restarted from a state before it, so nobody holds its
            # result (a lone trainer killed between its round and that round's checkpoint).
            # (Groups of node ids that share no member never pass this.)
            known = None
        if known is not None:
            if not known & remembered:
                raise SplitRound(
                    f"{what} of run {run_id} was completed by {len(known)} other members (or other processes "
                    f"of them); this group of {len(group)} trained apart from the run (a split): drop this work "
                    "and re-sync"
                )
            return
        settled = self.clock() - settle_s
        counted = [n for n, t in self.live(run_id, is_live) if t.since <= settled or n in group]
        if not granted and 2 * len(group) <= len(counted):
            raise SplitRound(
                f"{what} had {len(group)} member(s) but run {run_id} has {len(counted)} live trainers: "
                "a minority group is a split; drop this work and re-sync"
            )
        _keep(groups, at, remembered)


def _keep(records: OrderedDict, at: object, value: object) -> None:
    """Remember ``value`` for ``at``, forgetting the oldest records past ROUNDS_KEPT."""
    records[at] = value
    while len(records) > ROUNDS_KEPT:
        records.popitem(last=False)


def _nodes(group: frozenset) -> set[str]:
    """The node ids of a group of node ids or of (node id, incarnation) processes."""
    return {m[0] if isinstance(m, tuple) else m for m in group}
