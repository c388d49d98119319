"""The run's live-trainer view as heartbeat replies carry it, built once and versioned.

Every trainer heartbeats every second and every reply lists the run's live trainers
(coordinator/trainers.py, node/daemon/run_view.py). Built per request that is O(trainers) per
heartbeat, O(trainers^2) a second: at 10,000 trainers, 10^8 list entries a second, and a megabyte
in every reply. So the list is built once per change and carries a version; a node sends back the
version it holds, and while the view is still that version the reply says ``view_unchanged``
instead of listing everyone again (protocol/coordinator.proto, HeartbeatRequest.view_version).

When it is rebuilt: at the next ask after a trainer came, went, restarted or moved (correctness:
the survivors' quorum must stop counting a lost trainer at once), and after a trainer only reported
a new round or state hash, at most once per ``tick_s`` (every trainer does at every round: rebuilt
per report, the view would be rebuilt and resent to everyone thousands of times a round). A rebuild
that finds the same list keeps the version, so nobody is sent it again.

Versions start at this process's start time in milliseconds: a node holding a version of an
earlier coordinator process never matches this one's and gets the whole list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from murmur.protocol import coordinator_pb2 as pb

from .trainers import Trainer, Trainers


@dataclass(slots=True)
class View:
    version: int
    members: list[pb.LiveMember]
    key: list[tuple[str, str, str, int, str]]  # what the members say, to compare a rebuild with
    changes: int  # Trainers.changes and .progress when it was built
    progress: int
    built_at: float


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
        self._next_version = int(time.time() * 1000)

    def get(self, run_id: str, fresh: bool = False) -> View:
        """The run's view; ``fresh``: rebuilt now if anything changed (a ReportGone reply, which
        must not list the peer it just lost)."""
        now = self.clock()
        view = self._views.get(run_id)
        t = self.trainers
        if view is not None and view.changes == t.changes and (
            view.progress == t.progress or (not fresh and now - view.built_at < self.tick_s)
        ):
            return view
        live = self.live(run_id)
        key = [(n, m.incarnation, m.peer_address, m.round, m.state_hash) for n, m in live]
        if view is not None and key == view.key:
            view.changes, view.progress, view.built_at = t.changes, t.progress, now
            return view
        self._next_version += 1
        members = [pb.LiveMember(node_id=n, incarnation=i, peer_address=a, round=r, state_hash=h)
                   for n, i, a, r, h in key]
        view = self._views[run_id] = View(self._next_version, members, key, t.changes, t.progress, now)
        return view
