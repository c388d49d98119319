"""Where a starting node's state comes from: its local checkpoint, then the run's newer state.

A node (re)starting takes its own checkpoint first; if the run has moved on past it, the newest
state from peers (or waits for it while its holders may be restarting); where no live node serves
the run's newest state, the coordinator's kept copy; and where every holder of the run's newer
rounds is gone, it goes on from its own state numbered as the run's newest round, once the
coordinator grants that number (so no round of the run ever has two states). Runs on the loop,
before the training thread starts; what takes long runs in worker threads.

`Resume` is one side of `TrainingThread` (node/daemon/training_thread.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from murmur.errors import MurmurError
from murmur.node.daemon.thread_parts import ThreadParts
from murmur.protocol.wire import tensors_hash

# The shortest look for a state while waiting for it (a fetch's gRPC calls need a moment).
STATE_LOOK_MIN_S = 1.0


class Resume(ThreadParts):
    """The restore of a `TrainingThread` (whose __init__ sets every attribute named here)."""

    _ratio_base_step: int
    _committed_sent: int
    _last_shared: dict[str, Any]
    _checkpoint: dict[str, Any] | None

    async def restore(self) -> None:
        """Local checkpoint first; then peers, if the run has moved on (or for a first join)."""
        ckpt, self._checkpoint = self._checkpoint, None  # read while the data plane started (`prepare`)
        if ckpt is not None:
            try:
                await asyncio.to_thread(self.trainer.load_state_dict, ckpt)
                self.log(f"resumed from the local checkpoint at round {self.trainer.round}")
            except (MurmurError, KeyError, RuntimeError) as err:
                self.log(f"local checkpoint not usable ({err}); asking peers for the state")
        # The coordinator lists live trainers past our round, or saw the run reach a later round
        # (its holders may be restarting): starting from our own state would fork the run, a split
        # of one. Wait for that state instead: while live trainers hold it, for as long as it takes;
        # while nobody live does, up to state_fetch_timeout_s from here (then the newest state is
        # gone). From here, not from after the first fetch: with the holders dead, that fetch
        # itself retries their records for the whole timeout, and the wait was twice as long.
        gone_after = asyncio.get_running_loop().time() + self.s.state_fetch_timeout_s
        state = await self.dataplane.fetch_state(
            min_round=self.trainer.round + 1, timeout_s=self._fetch_budget(gone_after)
        )
        # The state came from the coordinator's kept copy (kept), or the kept copy was taken while
        # the holders were waited for (kept_taken: not asked for again).
        kept = kept_taken = False
        if state is None and self._kept_is_newest():
            # No live trainer serves the run's newest state, and the coordinator keeps it: no wait.
            state = await self._from_kept()
            kept = kept_taken = state is not None
        if state is None and self._run_is_ahead(gone_after):
            self.log(
                f"the run is at round {max(self.session.view.run_round(), self.session.view.newest)}, this node "
                f"at {self.trainer.round}: waiting for that state rather than training alone"
            )
        while True:
            while state is None and self._run_is_ahead(gone_after) and not self.stop.is_set():
                await self.stop.sleep(self.s.lease_wait_s)
                state = await self.dataplane.fetch_state(
                    min_round=self.trainer.round + 1, timeout_s=self._fetch_budget(gone_after)
                )
            # (A stop that cut the wait short says nothing of the holders: no renumbering then. A
            # chaos round's node, SIGTERMed while it waited, went on as the run's newest round
            # with its own older state and published it under that number before it left.)
            newest, mine = self.session.view.newest, self.trainer.round
            if state is not None or not self.session.in_rounds or newest <= mine or self.stop.is_set():
                break
            if self.session.kept.round > mine and not kept_taken:
                # The holders did not come back: the newest state that exists may be the one the
                # coordinator keeps. Take it, then claim the rounds past it (fewer are lost).
                state = await self._from_kept()
                if state is not None:
                    kept_taken = True
                    await asyncio.to_thread(self.trainer.load_shared_tensors, state)
                    state, mine = None, self.trainer.round
                    self._log_kept()
            # Every holder of the run's newer rounds is gone (state_fetch_timeout_s passed): their
            # rounds are lost with them. Go on from this node's state under the run's newest round
            # number, so no round of the run ever has two states (a holder that comes back later
            # takes this lineage, which is ahead of it). The coordinator grants that number to one
            # node: another one back at the same moment waits for this one's state instead.
            if await self.session.claim_lost_rounds(newest, mine):
                if self.faults is not None:  # --fault delay:lost_rounds:S: overtaken by another restart
                    await self.faults.delay("lost_rounds", self.session.info.node_id, newest)
                scratch = " (the operator's call: from scratch)" if self.session.from_scratch else ""
                self.log(
                    f"nobody serves the run's rounds {mine + 1}-{newest} any more (waited "
                    f"{self.s.state_fetch_timeout_s:g}s): they are lost; going on from this node's round {mine} as "
                    f"round {newest}{scratch}"
                )
                self.trainer.renumber(newest)
                break
            gone_after = asyncio.get_running_loop().time() + self.s.state_fetch_timeout_s
        if state is not None:
            await asyncio.to_thread(self.trainer.load_shared_tensors, state)
            self._ratio_base_step = self.trainer.step  # this node's bytes count from here
            if kept:
                self._log_kept()
            else:
                self.log(f"took the global state of round {self.trainer.round} from peers")
        self._last_shared = await asyncio.to_thread(self.trainer.shared_state)
        tensors = self.trainer.shared_tensors(self._last_shared)  # the copy just taken, not a second one
        self.dataplane.publish(self.trainer.round, tensors, await asyncio.to_thread(tensors_hash, tensors))
        self._committed_sent = self.trainer.sync.bytes.total_sent  # earlier bytes were committed before

    def _kept_is_newest(self) -> bool:
        """The coordinator keeps a state newer than this node's, at least the run's newest round,
        and no live trainer is past it (one would serve a newer state)."""
        kept, view = self.session.kept, self.session.view
        if not self.session.in_rounds or kept.round <= self.trainer.round:
            return False
        return kept.round >= view.newest and view.run_round() <= kept.round

    async def _from_kept(self) -> dict[str, Any] | None:
        """The coordinator's kept state of the run (node/daemon/kept_restore.py), or None (logged)."""
        from murmur.node.daemon.kept_restore import fetch_kept
        from murmur.node.net.state_transfer import StateError

        ident = getattr(self.dataplane, "ident", None)
        if ident is None:
            return None
        try:
            return await fetch_kept(ident, self.session.kept, self.session.info.run_id, self.s.state_fetch_timeout_s)
        except (StateError, TimeoutError) as err:
            self.log(f"could not restore the coordinator's kept state of round {self.session.kept.round}: {err}")
            return None

    def _log_kept(self) -> None:
        self.log(
            f"restored the run's state of round {self.trainer.round} from the coordinator's kept copy "
            f"(hash {self.session.kept.state_hash[:16]} verified): no live node served it"
        )

    def _fetch_budget(self, gone_after: float) -> float:
        """How long one look for the run's newer state may take while waiting for it: as long as
        a fetch may while live trainers hold it; else what is left until ``gone_after`` (a look
        at the expired records of dead holders ran out the rendezvous deadline, 8 s past a 5 s
        wait in the churn tests)."""
        if self.session.view.run_round() > self.trainer.round:
            return self.s.state_fetch_timeout_s
        return max(STATE_LOOK_MIN_S, gone_after - asyncio.get_running_loop().time())

    def _run_is_ahead(self, gone_after: float) -> bool:
        view = self.session.view
        if not self.session.in_rounds:
            return False
        if view.run_round() > self.trainer.round:
            return True
        return view.newest > self.trainer.round and asyncio.get_running_loop().time() < gone_after
