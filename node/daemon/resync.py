"""Keeping a training node on the run's one lineage between windows (the training thread's side).

Before a window: a lease whose work the coordinator refused is dropped; a split's state (the
coordinator refused its commits) is left for the state of the trainers outside it; rounds the run
completed already are skipped for its newest state. After a failed round: a re-sync from peers,
else the window undone; a round that no live node serves and the coordinator says the run got past
is numbered past once that lasts state_fetch_timeout_s (its holders died with it); and retries of
one round are paced. The training thread asks the loop and waits (`asyncio.run_coroutine_threadsafe`).

`Resync` is one side of `TrainingThread` (node/daemon/training_thread.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from murmur.node.daemon.round_finish import RoundFinisher
from murmur.node.daemon.thread_parts import ThreadParts
from murmur.protocol.wire import tensors_hash

# Failed rounds in a row at one round that are retried at once; the next ones wait (_pace_retries).
RETRIES_AT_ONCE = 3


class Resync(ThreadParts):
    """The re-syncs of a `TrainingThread` (whose __init__ sets every attribute named here; the
    leases' bookkeeping, `_forget_exhausted`, is node/daemon/round_handoff.py's)."""

    _finisher: RoundFinisher | None
    _last_shared: dict[str, Any]
    _behind_since: float | None
    _failures: int

    def _run_moved_on(self) -> bool:
        """Whether a live trainer reports a round past this node's (training thread; plain reads)."""
        return self.session.in_rounds and self.session.view.run_round() > self.trainer.round

    def _before_window(self) -> None:
        """Before a window (training thread): drop a lease whose work was refused; leave a split's
        state, or skip rounds the run has completed already, for the run's newest state."""
        trainer = self.trainer
        held = {seg.lease.lease_id for seg in trainer.carry.segments}
        if trainer.lease is not None:
            held.add(trainer.lease.lease_id)
        if held & self.session.lost_leases:
            # Its work is refused: take a new lease, and drop the steps carried (trained on it, or
            # before it on a shard whose later spans would then not start at the committed offset).
            trainer.lease, trainer.loader = None, None
            trainer.drop_carry()
            self._forget_exhausted(keep=set())  # the shards the carry ran out go back too
        split = self._split_group()
        if split:
            # The coordinator refused a commit as a split's: this node's state is that split's.
            # Take the run's from the trainers outside the split group.
            self.loop.call_soon_threadsafe(
                self.log, f"a round of this node's group ({len(split)} members) was a split (its commits "
                "were refused): re-syncing from the trainers outside it"
            )
            trainer.lease, trainer.loader = None, None
            self._resync_blocking(min_round=0, exclude=split)
        elif self._run_moved_on():
            # Live trainers completed the round this node would train next (it came late, or
            # was left out and caught up): training it is wasted, its update would be left out
            # again, and the others would wait for it in vain. Take the newest state instead.
            self._resync_blocking(min_round=trainer.round + 1)

    def _number_past_lost_rounds(self) -> None:
        """After a failed round with no newer state served (training thread). The coordinator may
        know the run got past this node's round while no live trainer holds it: a group was granted
        the round and all its members died (killed right after it completed, before a heartbeat
        said so). Every retry of that round is then refused as a split, for good. Once that has
        lasted state_fetch_timeout_s, the round is lost with its holders: go on numbered as the
        run's newest round, as a restart behind the run does (``restore``), so the next round is
        one no group has had."""
        view, mine = self.session.view, self.trainer.round
        if not self.session.in_rounds or view.newest <= mine or view.run_round() > mine:
            self._behind_since = None  # not behind, or a live trainer serves the way ahead
            return
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        if now - self._behind_since < self.s.state_fetch_timeout_s:
            return
        self._behind_since = None
        newest = view.newest
        claim = self.session.claim_lost_rounds(newest, mine)
        if not asyncio.run_coroutine_threadsafe(claim, self.loop).result():
            return  # another node goes on as that round: its state is taken at the next re-sync
        lost = f"round {newest}" if newest == mine + 1 else f"rounds {mine + 1}-{newest}"
        self.loop.call_soon_threadsafe(
            self.log, f"the run got to round {newest} but nobody serves {lost} (refused, and waited "
            f"{self.s.state_fetch_timeout_s:g}s): lost with their holders; going on from round {mine} as round {newest}"
        )
        self.trainer.renumber(newest)
        self._last_shared = self.trainer.shared_state()
        tensors = self.trainer.shared_tensors(self._last_shared)
        if self._finisher is not None:
            self._finisher.drain()  # its last round's state is published first, not after this one
        self.loop.call_soon_threadsafe(self.dataplane.publish, newest, tensors, tensors_hash(tensors))

    def _split_group(self) -> frozenset[str]:
        """The members of split rounds the coordinator refused since the last look (training
        thread; the list is appended to on the loop, and list.pop is atomic)."""
        groups = self.session.split_groups
        out: frozenset[str] = frozenset()
        while groups:
            out |= groups.pop()
        return out  # this node is in it: its own state is the split's

    def _resync_blocking(self, min_round: int | None = None, exclude: frozenset[str] = frozenset()) -> bool:
        """Take the newest state of a round >= ``min_round`` (default: this node's) from peers not
        in ``exclude``; False when nobody serves one (training thread)."""
        at = self.trainer.round if min_round is None else min_round
        coro = self.dataplane.fetch_state(min_round=at, timeout_s=self.s.state_fetch_timeout_s, exclude=exclude)
        state = asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        if state is None:
            return False
        carried = bool(self.trainer.carry.segments)
        self.trainer.load_shared_tensors(state)  # the local weights are the state's: carried steps dropped
        if carried:
            # The lease in hand went on past the carried steps' span, which is not committed now:
            # every lease goes back to its committed offset (the carry's run-out ones included).
            self.trainer.lease, self.trainer.loader = None, None
            self._forget_exhausted(keep=set())
        self._last_shared = self.trainer.shared_state()
        self.loop.call_soon_threadsafe(self.log, f"re-synced to round {self.trainer.round} from peers")
        return True


    def _pace_retries(self, failed_round: int) -> None:
        """After a failed round (training thread): retry at once, unless the node is still at the
        round that failed and it has failed RETRIES_AT_ONCE times in a row: then wait a little
        longer each time, up to lease_wait_s. A node that cannot get past a round (a result its
        peers no longer serve, a state nobody publishes yet) looped every ~70 ms before, for as
        long as that lasted (600 s in tests/test_churn_catchup.py's scenario)."""
        if self.trainer.round != failed_round:
            self._failures = 0  # re-synced past it: a new start
            return
        self._failures += 1
        if self._failures > RETRIES_AT_ONCE:
            self.stop.wait(min(self.s.lease_wait_s, 0.1 * 2 ** (self._failures - RETRIES_AT_ONCE)))
