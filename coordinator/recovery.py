"""A run whose newest state exists nowhere is never silently restarted: it waits for its operator.

Every holder of the run's newest rounds may be gone (all nodes stopped, their folders lost). A
node that then asks to go on numbered as the run's newest round (``ClaimRound`` with
``lost_rounds``) names the round of the state it would go on from. The coordinator grants it on
its own only when that is the newest state that exists anywhere it knows of, and is not a fresh
model under a run that trained:

* the coordinator keeps a newer state (coordinator/keeper.py): refused, take that one;
* the node's own state is at least the kept one and past round 0: granted, as before (the rounds
  after it are lost with their holders, a few at most while the coordinator keeps the state);
* a fresh model (round 0) where the run trained and nothing is kept: the run waits. A
  ``state_lost`` event, `murmur admin status` and the page say so, and the operator decides with
  `murmur admin runs recover RUN --from newest|scratch` (event ``recover``): go on from the newest
  state that exists (the node's, whatever it holds), or from a fresh model.

The wait and the decision are in the ledger (its counters), so they survive a coordinator restart;
a decision covers the round it was taken at, and a later loss waits for a new one.
"""

from __future__ import annotations

from collections.abc import Callable

from murmur.errors import MurmurError

from .store import Store

START_FROM = ("newest", "scratch")


class WaitForOperator(MurmurError):
    code = "ABORTED"


class TakeKept(MurmurError):
    code = "ABORTED"


class RecoverError(MurmurError):
    code = "FAILED_PRECONDITION"


def _waiting_key(run_id: str) -> str:
    return f"state_lost:{run_id}"  # the round the run waits at, +1 (0: not waiting)


def _decision_key(run_id: str) -> str:
    return f"recover:{run_id}"  # 1 + the index in START_FROM (0: none)


def _decided_at_key(run_id: str) -> str:
    return f"recover_round:{run_id}"  # the round the decision covers, +1


class Recovery:
    def __init__(self, store: Store, kept_round: Callable[[str], int]) -> None:
        self.store, self.kept_round = store, kept_round
        # run -> the round it waits at (-1: not waiting), read from the ledger once: every heartbeat
        # reply asks (a query per heartbeat was 5% of the coordinator's time at 1,000 nodes), and
        # only this class changes it, after its transaction commits.
        self._waiting_at: dict[str, int] = {}

    def _waiting_round(self, run_id: str) -> int:
        at = self._waiting_at.get(run_id)
        if at is None:
            at = self._waiting_at[run_id] = self.store.counter(_waiting_key(run_id)) - 1
        return at

    def waiting(self, run_id: str) -> str:
        """Why the run waits for its operator ("" when it does not)."""
        at = self._waiting_round(run_id)
        if at < 0:
            return ""
        return (
            f"the run's newest state (round {at}) exists nowhere: every node that held it is gone and the "
            f"coordinator keeps none; decide with `murmur admin runs recover {run_id} --from newest|scratch`"
        )

    def judge(self, run_id: str, round_id: int, from_round: int, node_id: str) -> bool:
        """May ``node_id`` go on from its state of ``from_round`` numbered as ``round_id``? True:
        granted (from a fresh model when the operator said scratch: the return value); raises
        TakeKept or WaitForOperator otherwise."""
        kept = self.kept_round(run_id)
        decided = self.store.counter(_decision_key(run_id))
        covers = self.store.counter(_decided_at_key(run_id)) - 1
        if decided and round_id <= covers:
            if decided == 1 + START_FROM.index("scratch"):
                return True
            if kept > from_round:
                raise TakeKept(f"the coordinator keeps round {kept} of run {run_id}: restore from it")
            return False
        if kept > from_round:
            raise TakeKept(f"the coordinator keeps round {kept} of run {run_id}: restore from it")
        if from_round > 0 or round_id <= 0:
            return False
        self._wait(run_id, round_id, node_id)
        raise WaitForOperator(self.waiting(run_id))

    def _wait(self, run_id: str, round_id: int, node_id: str) -> None:
        if self._waiting_round(run_id) == round_id:
            return
        with self.store.write():
            self.store.set_counter(_waiting_key(run_id), round_id + 1)
            self.store.event("state_lost", run_id=run_id, node_id=node_id, round=round_id,
                             kept_round=self.kept_round(run_id))
        self._waiting_at[run_id] = round_id

    def recover(self, run_id: str, start_from: str) -> None:
        """The operator's decision for a run that waits (RecoverError when it does not)."""
        if start_from not in START_FROM:
            raise RecoverError(f"--from must be one of {', '.join(START_FROM)}, got {start_from!r}")
        at = self._waiting_round(run_id)
        if at < 0:
            raise RecoverError(f"run {run_id} is not waiting for a decision: its newest state is not lost")
        with self.store.write():
            self.store.set_counter(_decision_key(run_id), 1 + START_FROM.index(start_from))
            self.store.set_counter(_decided_at_key(run_id), at + 1)
            self.store.set_counter(_waiting_key(run_id), 0)
            self.store.event("recover", run_id=run_id, start_from=start_from, round=at,
                             kept_round=self.kept_round(run_id))
        self._waiting_at[run_id] = -1
