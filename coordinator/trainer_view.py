"""The run's live-trainer view as heartbeat replies carry it: built once, versioned, sent as changes.

Every trainer heartbeats every second and every reply stands for the run's live trainers
(coordinator/trainers.py, node/daemon/run_view.py). Listed whole in every reply that is
O(trainers) a heartbeat, O(trainers^2) a second: at 10,000 trainers 10^8 entries a second and a
megabyte a reply. So the view is built once per change and carries a version; a node sends back
the version it holds (protocol/coordinator.proto, HeartbeatRequest.view_version) and the reply
says ``view_unchanged``, or lists only what changed since (``view_delta``: the trainers that came or
changed, and ``view_removed``), or, for a version too old or unknown, the whole view.

When it is rebuilt: at the next ask after a trainer came, went, restarted or moved (the
survivors' quorum must stop counting a lost trainer at once), unless the last rebuild was very
recent for its cost (once a rebuild takes milliseconds, at most a tenth of the time goes to
rebuilding: a join storm of 10,000 trainers would otherwise rebuild at every heartbeat); after
a trainer only reported a new round or state hash, at most once per ``tick_s`` (every trainer does
at every round). A rebuild that finds the same list keeps the version, so nobody is sent anything.

A reply that lists the whole view (a node's first, or one too far behind: 10,000 trainers starting
together each get one, some 1.6 MB) is not built member by member: the view's ``members`` are
serialized once per version, as a HeartbeatReply's field 7, at the first reply that needs them
(``View.members_field``), and each such reply is its other fields serialized and those bytes
appended (protobuf's wire format concatenates: a repeated field's entries append). Building and
serializing the 10,000 members for each reply cost the coordinator's loop 6-15 ms a reply
(coordinator/preserialized.py sends the bytes as they are; docs/coordinator.md, "At scale").

Versions carry a random prefix of this process: a node holding a version of an earlier
coordinator process matches none of this one's (but with odds of 2^-31) and gets the whole list.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from murmur.protocol import coordinator_pb2 as pb

from .trainers import Trainer, Trainers

HISTORY = 16  # versions per run a delta can start from; an older one gets the whole view
REBUILD_SHARE = 0.1  # the most of the coordinator's time rebuilding a changing view may take,
PACE_FROM_S = 0.002  # once a rebuild takes this long (some thousand trainers); below, never paced

Entry = tuple[str, str, int, str]  # incarnation, peer address, round, state hash


@dataclass(slots=True)
class Delta:
    changed: list[pb.LiveMember]
    removed: list[str]


@dataclass(slots=True)
class View:
    version: int
    # A HeartbeatReply holding only the members: built in place (measured at 10,000 trainers: 5.6
    # ms against 8.9 ms for a list of LiveMember) and serialized as it is (0.7 ms against 4.6 ms
    # for a reply made of the list).
    listing: pb.HeartbeatReply
    entries: dict[str, Entry]  # node id -> what its member says, to compare and diff with
    changes: int  # Trainers.changes and .progress when it was built
    progress: int
    built_at: float
    deltas: dict[int, Delta] = field(default_factory=dict)  # from an older version to this one
    _members_field: bytes | None = None  # ``listing`` serialized; made at first use

    @property
    def members(self) -> Sequence[pb.LiveMember]:
        return self.listing.members

    def members_field(self) -> bytes:
        """``members`` serialized as a HeartbeatReply's field 7 entries, made once for this version
        (a view's members never change: a new list is a new View with a new version, so these
        bytes can never stand for another version's list). Appended to a reply serialized without
        members, they parse as that reply listing the whole view."""
        if self._members_field is None:
            self._members_field = self.listing.SerializeToString()
        return self._members_field


class TrainerViews:
    def __init__(
        self,
        trainers: Trainers,
        live: Callable[[str], list[tuple[str, Trainer]]],
        tick_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.trainers, self.live, self.tick_s, self.clock = trainers, live, tick_s, clock
        self._views: dict[str, View] = {}
        self._history: dict[str, OrderedDict[int, dict[str, Entry]]] = {}
        self._next_version = secrets.randbits(31) << 31
        self._pause_until = 0.0  # time.monotonic() before which a trainer's arrival waits (pacing)

    def get(self, run_id: str, fresh: bool = False) -> View:
        """The run's view; ``fresh``: rebuilt now if anything changed (a ReportGone reply, which
        must not list the peer it just lost)."""
        now = self.clock()
        view = self._views.get(run_id)
        t = self.trainers
        if view is not None and not fresh:
            moved = view.changes != t.changes and time.monotonic() >= self._pause_until
            progressed = view.progress != t.progress and now - view.built_at >= self.tick_s
            if not moved and not progressed:
                return view
        elif view is not None and (view.changes, view.progress) == (t.changes, t.progress):
            return view
        started = time.monotonic()
        entries = {n: (m.incarnation, m.peer_address, m.round, m.state_hash) for n, m in self.live(run_id)}
        if view is not None and entries == view.entries:
            view.changes, view.progress, view.built_at = t.changes, t.progress, now
        else:
            self._next_version += 1
            listing = pb.HeartbeatReply()
            add = listing.members.add
            for n, (i, a, r, h) in entries.items():
                add(node_id=n, incarnation=i, peer_address=a, round=r, state_hash=h)
            view = self._views[run_id] = View(self._next_version, listing, entries, t.changes, t.progress, now)
            history = self._history.setdefault(run_id, OrderedDict())
            history[view.version] = entries
            while len(history) > HISTORY:
                history.popitem(last=False)
        took = time.monotonic() - started
        self._pause_until = started + took / REBUILD_SHARE if took >= PACE_FROM_S else 0.0
        return view

    def delta(self, run_id: str, view: View, since: int) -> Delta | None:
        """What changed from version ``since`` to ``view`` (None: ``since`` is too old or unknown;
        the whole view then). Computed once per pair."""
        known = view.deltas.get(since)
        if known is not None:
            return known
        old = self._history.get(run_id, {}).get(since)
        if old is None:
            return None
        changed = [m for m in view.members if old.get(m.node_id) != view.entries[m.node_id]]
        known = view.deltas[since] = Delta(changed, [n for n in old if n not in view.entries])
        return known
