"""The fewest members a node's first round may have: the peers its start waited for (--min-peers).

A node started with ``--min-peers N`` waits until N trainers are in the DHT, itself included
(node/daemon/peer_dataplane.py, ``wait_for_peers``), and a peer still starting counts (its record
says round -1). Counting them is not meeting them: the coordinator lists a trainer only once it
holds a state, so this node's first rendezvous waited for nobody, and when its DHT read missed the
starting peer its quorum was itself alone. It trained round after round alone while the peer it
had counted still loaded (CI, test_churn_restart.py: B took the run's state, trained rounds 4 to 9
in two seconds, and A, back from its checkpoint a second later, found the run five rounds past
it). So the count holds on as a floor: the rendezvous waits for N members and a round group of
fewer does not start (it meets again), until N have met at a rendezvous once. It lapses when the
start's wait (``peers_wait_s``) has passed again without that, as the wait itself would have;
peers counted that were since seen dead (their address refused a connection) are not waited for.

Thread safety: asked from the DHT's worker threads (the rendezvous polls) and the loop; plain
attribute reads and writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection


class StartFloor:
    def __init__(
        self,
        dead: Callable[[], Collection[str]] = frozenset,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dead, self._log, self._clock = dead, log, clock
        self._counted: frozenset[str] = frozenset()
        self._wanted = 1
        self._until = -float("inf")

    def hold(self, counted: Collection[str], wanted: int, for_s: float) -> None:
        """The start wanted ``wanted`` peers and counted these node ids (this one included):
        rounds wait for ``wanted`` members, less those of the counted seen dead since."""
        if wanted > 1 and len(counted) > 1:
            self._counted, self._wanted, self._until = frozenset(counted), wanted, self._clock() + for_s

    def need(self) -> int:
        """The fewest members a round of the whole run may have now (1: no floor)."""
        if len(self._counted) <= 1:
            return 1
        if self._clock() >= self._until:
            self._lift(f"the {self._wanted} peers the start waited for never met at a rendezvous "
                       "within the start's wait: rounds go on with whoever is there")
            return 1
        return max(1, min(self._wanted, len(self._counted - set(self._dead()))))

    def met(self, members: int) -> None:
        """A rendezvous of the whole run met ``members`` peers: enough lifts the floor for good."""
        if len(self._counted) > 1 and members >= self.need():
            self._lift("")

    def _lift(self, why: str) -> None:
        self._counted = frozenset()
        if why and self._log is not None:
            self._log(why)
