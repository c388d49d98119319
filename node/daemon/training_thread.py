"""The node's training thread and its bridge to the daemon's asyncio loop.

The thread trains window after window (node/daemon/window.py) and touches no socket. It talks to
the loop only through `asyncio.run_coroutine_threadsafe` (a lease request or a state fetch: it
blocks until the answer, or until a stop ends the wait) and `loop.call_soon_threadsafe` (commits,
round records and stop requests: fire and forget). Everything it hands over is a finished value
(a record, a list of commits, tensors it no longer writes).

Stopping: the thread finishes the step it is in and returns. The tokens of a half-done window are
*not* committed: they never reached the global model, so the shard is re-leased from its committed
offset and they are trained again.

This module holds the thread's body (the loop of windows, a failed round's handling, the lease
requests); its other sides are modules of their own:

    node/daemon/resume.py         before training: the checkpoint, then the run's newer state
    node/daemon/resync.py         between windows: staying on the run's one lineage
    node/daemon/round_handoff.py  after a window: the round's record, commits and checkpoint
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from murmur.node.daemon import snapshot
from murmur.node.daemon.dataplane import DataPlane
from murmur.node.daemon.metrics import NodeMetrics
from murmur.node.daemon.ranks import LocalRanks
from murmur.node.daemon.resume import Resume
from murmur.node.daemon.resync import Resync
from murmur.node.daemon.round_finish import RoundFinisher
from murmur.node.daemon.round_handoff import RoundHandoff
from murmur.node.daemon.session import CoordinatorSession
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import StateDir
from murmur.node.daemon.stop import StopSignal
from murmur.node.daemon.training import NodeTrainer
from murmur.node.daemon.window_types import LeaseView, Segment
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.net.faults import FaultInjector
from murmur.node.train.step import evaluate
from murmur.optim.exchange import ExchangeError
from murmur.protocol.fork_guard import FORK_GUARD
from murmur.protocol.runconfig import RunConfig


@dataclass(slots=True)
class Prepared:
    """What a node makes ready while its data plane starts: its trainer (the model, the inner
    optimizer and the sync, their exchange attached later) and its local checkpoint, read (None:
    there is none), applied by ``TrainingThread.restore``."""

    trainer: NodeTrainer
    checkpoint: dict[str, Any] | None


async def prepare(*, cfg: RunConfig, dataset: Dataset, device: torch.device, state: StateDir, node_id: str,
                  settings: NodeSettings, threads: int, ranks: LocalRanks | None = None,
                  faults: FaultInjector | None = None) -> Prepared:
    """Build the trainer and read the checkpoint in a worker thread: the loop sends the heartbeats
    meanwhile, and a node's DHT starts beside it (node/daemon/node.py). Never under a fork of the
    DHT's process (protocol/fork_guard.py): what the build changes would reach the child
    half-changed."""

    def work() -> Prepared:
        with FORK_GUARD:
            if faults is not None:  # --fault delay:build_model:S: a large model on a slow machine
                faults.pause("build_model", node_id, 0)
            if threads:
                torch.set_num_threads(threads)  # OpenMP keeps the thread count per thread
            trainer = NodeTrainer(cfg, dataset, device, None, round_timeout_s=settings.round_timeout_s, ranks=ranks)
            return Prepared(trainer, state.load_checkpoint())

    return await asyncio.to_thread(work)


class TrainingThread(Resume, Resync, RoundHandoff):
    """Built on the loop once the node has joined, its data plane is up and its trainer is built
    (``prepare``); ``train`` is the training thread's body, ``restore`` runs on the loop before
    it. What takes long (building the model, reading a checkpoint, hashing the state) runs in
    worker threads: the loop sends the heartbeats, and a loop blocked past the heartbeat TTL has
    the node marked lost (a testnet node's model build, 2 s on an idle machine, did that under load
    at its every restart)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        prepared: Prepared,
        dataplane: DataPlane,
        session: CoordinatorSession,
        state: StateDir,
        metrics: NodeMetrics,
        stop: StopSignal,
        settings: NodeSettings,
        threads: int,
        max_rounds: int,
        log: Callable[[str], None],
        faults: FaultInjector | None = None,
    ) -> None:
        self.cfg, self.dataplane, self.session, self.state = cfg, dataplane, session, state
        self.metrics, self.stop, self.s, self.log = metrics, stop, settings, log
        self.threads, self.max_rounds = threads, max_rounds
        self.faults = faults  # --fault: the delay points on this side of the daemon
        self.loop = asyncio.get_running_loop()
        if threads:
            torch.set_num_threads(threads)
        self.trainer = trainer = prepared.trainer
        trainer.attach(dataplane.exchange)
        self._checkpoint = prepared.checkpoint  # applied by restore, then let go
        # sync.round_budget = "speed": the window's share comes from the members' speeds
        trainer.group_rates = self._member_rates
        if faults is not None:  # --fault slow:FACTOR: a slower machine
            node_id = session.info.node_id
            trainer.after_step = lambda s: faults.slow_step(node_id, trainer.round + 1, s)
        # A step waiting for its exchange would wait up to round_timeout_s: a stop ends the wait.
        # Nothing partial is applied (the round fails as a whole) and the window is not committed.
        stop.on_request(lambda reason: self.trainer.meter.abort(f"the node is stopping ({reason})"))
        self._ratio_base_step = 0  # the step this node's byte counter started from
        # Commits carry the bytes sent since the previous commit (the coordinator sums them): the
        # counter's value at the last commit, set again once a checkpoint restored the counter.
        self._committed_sent = 0
        self._finisher: RoundFinisher | None = None  # set while the training thread runs
        # Leases the window under way ran out (training thread), and those of finished rounds
        # whose commits the finisher has not handed over yet (round -> lease ids).
        self._window_exhausted: set[str] = set()
        self._exhausted_by_round: dict[int, set[str]] = {}
        # The shared state (a CPU copy) of this node's last round: a window whose round failed,
        # with no newer state to take, is undone from it. Set by restore and after every round.
        self._last_shared: dict[str, Any] = {}
        # Since when (monotonic) this node's rounds have failed while the coordinator said the run
        # got past its round and nobody served that state (training thread; None: not so).
        self._behind_since: float | None = None
        self._failures = 0  # rounds failed in a row at this node's round (training thread)

    def _member_rates(self) -> list[float]:
        """The last round's members' compute speeds, this node's as measured now (training thread)."""
        rates = self.dataplane.member_rates()
        me = self.session.info.node_id
        if me in rates:
            rates[me] = self.trainer.speed.rate
        return list(rates.values())

    # -- the training thread ----------------------------------------------------------------------

    def train(self) -> None:
        """The training thread: windows until a stop, the schedule's end or max_rounds."""
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP keeps the thread count per thread
        trainer, cfg = self.trainer, self.cfg
        val = eval_batches(trainer.dataset, trainer.batch, trainer.seq_len, cfg.train.eval_batches)
        eval_every = max(1, round(cfg.train.eval_every / trainer.h))  # in rounds
        if trainer.round == 0:
            v = evaluate(trainer.eval_model(), val, trainer.device, cfg.train.dtype)
            self.loop.call_soon_threadsafe(self._record_start, v)
        # The finisher's threads hand each round to the loop: its state to publish once hashed, then
        # the round itself once its checkpoint is on disk, where `_after_round` logs and commits it.
        hand_over = functools.partial(self.loop.call_soon_threadsafe, self._after_round)
        publish = functools.partial(self.loop.call_soon_threadsafe, self.dataplane.publish)
        finisher = self._finisher = RoundFinisher(self._save_checkpoint, hand_over, publish)
        try:
            self._windows(finisher, val, eval_every)
        except BaseException:
            finisher.close(raise_failure=False)
            raise
        finisher.close()  # every finished round checkpointed and handed to the loop

    def _windows(self, finisher: RoundFinisher, val: list, eval_every: int) -> None:
        trainer, cfg = self.trainer, self.cfg
        rounds_here = 0
        while not self.stop.is_set():
            if trainer.step >= cfg.train.steps:
                why = f"the run's schedule of {cfg.train.steps} steps is done"
                self.loop.call_soon_threadsafe(self.stop.request, why)
                break
            self._before_window()
            self.session.window_round = trainer.round + 1
            try:
                result = trainer.run_window(self._next_lease_blocking, self.stop.is_set)
            except ExchangeError as err:
                if self.stop.is_set():
                    break
                self._forget_exhausted(keep=set())  # handed back: trained again from their offsets
                # Nothing partial was applied. Re-sync from peers; the window's tokens are
                # trained again (the lease restarts from its committed offset).
                self.loop.call_soon_threadsafe(self.log, f"round {trainer.round + 1} failed ({err}); re-syncing")
                trainer.lease, trainer.loader = None, None
                failed_round = trainer.round
                if self._resync_blocking():
                    self._behind_since = None
                else:
                    # Nobody serves this round's state or a newer one: the failed window is undone
                    # here too (global copy, counters, the fragments' exchange round ids), so the
                    # retry is the same exchange round as the peers', not the next one.
                    trainer.load_shared_state(self._last_shared)
                    self._number_past_lost_rounds()
                self._pace_retries(failed_round)
                continue
            self._behind_since = None
            self._failures = 0
            if result.stopped:
                break
            rounds_here += 1
            v = None
            if result.round % eval_every == 0 or trainer.step >= cfg.train.steps:
                v = evaluate(trainer.eval_model(), val, trainer.device, cfg.train.dtype)
            record = self._round_record(result, v)
            commits = self._window_commits(result, record)
            # The leases this window ran out stay named as exhausted until its commits are handed
            # over (`_after_round`); those it does not commit (left out) go back now. Those run out
            # while it filled (sync.fill_wait) hold the next window's steps: named until its round.
            carried = {seg.lease.lease_id for seg in trainer.carry.segments if seg.exhausted}
            ran_out = self._forget_exhausted(keep={c.lease_id for c in commits}, carried=carried)
            if ran_out:
                self._exhausted_by_round[result.round] = ran_out
            # Copies the next window cannot touch; hashing, the checkpoint and the hand-over to
            # the loop happen beside it, in order (node/daemon/round_finish.py): the round is
            # logged and committed only once its checkpoint is on disk.
            # Where the GPU has room they are copies on the GPU, which the finisher moves to the
            # CPU beside the next window (node/daemon/snapshot.py): copied to the CPU here, they
            # held the training thread 0.55 s a round on the H200.
            t0 = time.perf_counter()
            on_device = trainer.snapshot_on_device()
            state = self._last_shared = trainer.shared_state(on_device=on_device)
            shared = trainer.shared_tensors(state)
            checkpoint = None
            if self.s.checkpoint_every_rounds and result.round % self.s.checkpoint_every_rounds == 0:
                checkpoint = trainer.state_dict(shared=state, on_device=on_device)
            taken = snapshot.Taken.now(trainer.device) if on_device else None
            # The training thread's time between windows.
            record["snapshot_seconds"] = round(time.perf_counter() - t0, 4)
            record["snapshot_on_device"] = on_device
            finisher.submit(record, commits, shared, checkpoint, taken)
            if self.max_rounds and rounds_here >= self.max_rounds:
                self.loop.call_soon_threadsafe(self.stop.request, f"--max-rounds {self.max_rounds} reached")
                break

    def _next_lease_blocking(self, done: Segment | None, give_up: Callable[[], bool] | None = None
                             ) -> LeaseView | None:
        """From the training thread: wait for a new lease (``give_up``: None once it says so). A
        shard that ran out (``done``) is not committed now but with the round whose update holds
        its steps, so its tokens count only if that round completes: the coordinator keeps it
        held (``exhausted``) and grants another beside it."""
        if done is not None:
            self.session.exhausted.add(done.lease.lease_id)  # read by acquire while this thread waits
            self._window_exhausted.add(done.lease.lease_id)
        elif self._finisher is not None:
            # A lease lost or dropped (a failed or left-out window): the coordinator hands the
            # shard back from its committed offset, so the earlier windows' commits on it must
            # reach the loop first (acquire sends them before asking). A shard that ran out needs
            # no such wait: the leases that earlier windows ran out stay named as exhausted until
            # their commits are handed over, so none is handed back meanwhile; waiting here cost a
            # GPU node 2-8 s each time a shard ran out (the finisher writes 1.5 GB checkpoints).
            self._finisher.drain()
        # A shard that ran out in this window (``done``) with no other free: the window ends with
        # the steps it has rather than wait for a shard (node/daemon/window.py's dry steps).
        may_end = done is not None and give_up is None and self.trainer.can_end_dry()
        return asyncio.run_coroutine_threadsafe(
            self.session.acquire(give_up, may_end_window=may_end), self.loop
        ).result()
