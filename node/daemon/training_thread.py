"""The node's training thread and its bridge to the daemon's asyncio loop.

The thread trains window after window (node/daemon/training.py) and touches no socket. It talks to
the loop only through `asyncio.run_coroutine_threadsafe` (a lease request or a state fetch: it
blocks until the answer, or until a stop ends the wait) and `loop.call_soon_threadsafe` (commits,
round records and stop requests: fire and forget). Everything it hands over is a finished value
(a record, a list of commits, tensors it no longer writes).

Stopping: the thread finishes the step it is in and returns. The tokens of a half-done window are
*not* committed: they never reached the global model, so the shard is re-leased from its committed
offset and they are trained again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from murmur.errors import MurmurError
from murmur.node.daemon import snapshot
from murmur.node.daemon.dataplane import DataPlane
from murmur.node.daemon.metrics import NodeMetrics
from murmur.node.daemon.ranks import LocalRanks
from murmur.node.daemon.round_finish import RoundFinisher
from murmur.node.daemon.session import CoordinatorSession
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import PendingCommit, StateDir
from murmur.node.daemon.stop import StopSignal
from murmur.node.daemon.training import LeaseView, NodeTrainer, Segment, WindowResult
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.net.faults import FaultInjector
from murmur.node.train.step import evaluate
from murmur.optim.exchange import ExchangeError
from murmur.protocol.model_shape import ddp_bytes
from murmur.protocol.reachability import is_client
from murmur.protocol.runconfig import RunConfig
from murmur.protocol.wire import tensors_hash

# The shortest look for a state while waiting for it (a fetch's gRPC calls need a moment).
STATE_LOOK_MIN_S = 1.0
# Failed rounds in a row at one round that are retried at once; the next ones wait (_pace_retries).
RETRIES_AT_ONCE = 3


class TrainingThread:
    """Built on the loop (``build``), once the node has joined and its data plane is up; ``train``
    is the training thread's body, everything else runs on the loop. What takes long (building
    the model, reading a checkpoint, hashing the state) runs in worker threads: the loop sends
    the heartbeats, and a loop blocked past the heartbeat TTL has the node marked lost (a testnet
    node's model build, 2 s on an idle machine, did that under load at its every restart)."""

    @classmethod
    async def build(cls, *, cfg: RunConfig, dataset: Dataset, device: torch.device, dataplane: DataPlane,
                    session: CoordinatorSession, settings: NodeSettings, threads: int,
                    ranks: LocalRanks | None = None, faults: FaultInjector | None = None,
                    **rest: Any) -> TrainingThread:
        """The training thread's state, with its trainer (the model and optimizer) built in a worker thread."""

        def trainer() -> NodeTrainer:
            if faults is not None:  # --fault delay:build_model:S: a large model on a slow machine
                faults.pause("build_model", session.info.node_id, 0)
            if threads:
                torch.set_num_threads(threads)  # OpenMP keeps the thread count per thread
            return NodeTrainer(
                cfg, dataset, device, dataplane.exchange, round_timeout_s=settings.round_timeout_s, ranks=ranks
            )

        built = await asyncio.to_thread(trainer)
        return cls(
            cfg=cfg, trainer=built, dataplane=dataplane, session=session, settings=settings, threads=threads,
            faults=faults, **rest,
        )

    def __init__(
        self,
        *,
        cfg: RunConfig,
        trainer: NodeTrainer,
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
        self.trainer = trainer
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

    # -- on the loop: before training -------------------------------------------------------------

    async def restore(self) -> None:
        """Local checkpoint first; then peers, if the run has moved on (or for a first join)."""
        ckpt = await asyncio.to_thread(self.state.load_checkpoint)
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

    def _round_members(self) -> list[str]:
        """The group of the last completed round, which commits name (the coordinator's split check)."""
        return list(self.dataplane.last_round_members()) if self.session.in_rounds else []

    def _member_rates(self) -> list[float]:
        """The last round's members' compute speeds, this node's as measured now (training thread)."""
        rates = self.dataplane.member_rates()
        me = self.session.info.node_id
        if me in rates:
            rates[me] = self.trainer.speed.rate
        return list(rates.values())

    def _sent_since_commit(self) -> int:
        """Bytes sent since the previous commit (training thread), counted as committed from now."""
        total = self.trainer.sync.bytes.total_sent
        delta, self._committed_sent = max(0, total - self._committed_sent), total
        return delta

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

    def _forget_exhausted(self, keep: set[str], carried: set[str] = frozenset()) -> set[str]:
        """End the window's bookkeeping of the leases it ran out (training thread): those in
        ``carried`` (run out by the steps the next window carries) stay the next window's; the
        others not in ``keep`` are no longer named as exhausted (the coordinator hands them back);
        returns the rest, named until this window's commits are handed over. (A lease may be in
        both: the window committed a span of it and the carry runs it out.)"""
        ran_out = self._window_exhausted
        self._window_exhausted = ran_out & carried
        self.session.exhausted.difference_update(ran_out - keep - carried)
        return (ran_out & keep) - carried

    def _save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The round finisher's write (its thread); ``--fault delay:checkpoint:S`` slows it."""
        if self.faults is not None:
            self.faults.pause("checkpoint", self.session.info.node_id, int(checkpoint["shared"]["round"]))
        self.state.save_checkpoint(checkpoint)

    def _window_commits(self, result: WindowResult, record: dict[str, Any]) -> list[PendingCommit]:
        """What a completed window commits: its spans of leased shards, or nothing when the round
        went on without this node's update (training thread)."""
        if not record["contributed"]:
            # Left out (it came late and caught up from the others): these tokens never reached
            # the model, so nothing is committed, and the next window trains them again from the
            # lease's committed offset (the coordinator hands the same lease back). Training on
            # past them would have the next window's commit refused too.
            self.trainer.lease, self.trainer.loader = None, None
            self.trainer.drop_carry()  # steps trained on that lease while the round was in flight
            self.loop.call_soon_threadsafe(
                self.log, f"round {result.round}: this node's update was left out; its tokens are trained again"
            )
            return []
        spans = [seg for seg in result.segments if seg.end > seg.start]
        sent = self._sent_since_commit() if spans else 0  # the first span carries the round's bytes
        members = self._round_members()
        return [
            PendingCommit(
                seg.lease.lease_id,
                seg.lease.shard_id,
                seg.start,
                seg.end,
                result.round,
                result.loss,
                sent if i == 0 else 0,
                result.seconds,
                members,
                record["val_loss"] if i == 0 else None,
            )
            for i, seg in enumerate(spans)
        ]

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
        # the steps it has rather than wait for a shard (training.py's dry steps).
        may_end = done is not None and give_up is None and self.trainer.can_end_dry()
        return asyncio.run_coroutine_threadsafe(
            self.session.acquire(give_up, may_end_window=may_end), self.loop
        ).result()

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

    def _round_record(self, result: WindowResult, val: float | None) -> dict[str, Any]:
        t = self.trainer
        sent = t.sync.bytes.total_sent
        peers = self.dataplane.last_round_members()
        k = max(2, len(peers))
        ddp = ddp_bytes(t.n_params, k, t.step - self._ratio_base_step)
        return {
            "round": result.round,
            "step": t.step,
            "time": time.time(),
            "node": self.session.info.node_id,
            "run": self.session.info.run_id,  # join.json goes with a clean leave; `murmur export` reads it here
            "loss": result.loss,
            "val_loss": val,
            "tokens": result.tokens,
            "steps": result.steps,  # this window's inner steps (sync.round_budget = "speed": its share)
            "tokens_per_s": result.tokens / result.seconds if result.seconds > 0 else 0.0,
            "seconds": result.seconds,
            "compute_seconds": result.compute_seconds,
            "rate": t.speed.rate,  # compute inner steps/s (EMA), announced to peers (sync.round_budget)
            "exchange_wait_seconds": result.exchange_wait_seconds,
            # Where a fast member's window went (benchmarks/heterogeneous.py): it started, its last
            # step had computed (it waits for the round from here), it ended (time - eval).
            "window_started": result.started,
            "arrived": result.arrived,
            "window_ended": result.started + result.seconds,
            # sync.fill_wait: steps trained while this round was in flight (the next window's), and
            # those of the last round's flight, committed with this one (in "tokens", not "steps")
            "filled": result.filled,
            "carried": result.carried,
            "carried_shards": result.carried_shards,  # (a fill that ran a shard out took the next one)
            "bytes_sent": sent,
            "bytes_received": t.sync.bytes.total_received,
            "compression": ddp / sent if sent else 0.0,
            "peers": len(peers),
            # False: the round completed without this node's update (it caught up from peers)
            "contributed": not self.session.in_rounds or self.session.info.node_id in peers,
            "hash": None,  # the global state's, set off the training thread (RoundFinisher)
            "shards": [s.lease.shard_id for s in result.segments],
        }

    # -- on the loop: what a round hands back -----------------------------------------------------

    def _record_start(self, val: float) -> None:
        self.state.append_round(
            {
                "round": 0,
                "step": 0,
                "time": time.time(),
                "val_loss": val,
                "node": self.session.info.node_id,
                "run": self.session.info.run_id,
                "hash": self.trainer.global_hash(),
            }
        )
        self.log(f"round    0 | val {val:.4f}")

    def _after_round(
        self,
        record: dict[str, Any],
        commits: list[PendingCommit],
        shared: list[tuple[str, torch.Tensor]],
        digest: bytes,
    ) -> None:
        m = self.metrics
        m.round, m.steps, m.loss = record["round"], record["step"], record["loss"]
        m.tokens_per_s, m.tokens_total = record["tokens_per_s"], m.tokens_total + record["tokens"]
        m.bytes_sent_total, m.bytes_received_total = record["bytes_sent"], record["bytes_received"]
        m.compression_ratio, m.peers = record["compression"], record["peers"]
        m.compute_seconds_total += record["compute_seconds"]
        m.exchange_wait_seconds_total += record["exchange_wait_seconds"]
        m.wall_seconds_total += record["seconds"]
        self.session.tokens_per_s = record["tokens_per_s"]
        self.dataplane.rate = record["rate"]  # announced with the round's state (publish, below)
        self.session.queue_commits(commits)
        # Their commits are pending now and go out before any lease request: no longer exhausted.
        self.session.exhausted.difference_update(self._exhausted_by_round.pop(record["round"], ()))
        self.session.queue_rejections(self.dataplane.take_rejections())
        self.state.append_round(record)  # (its state was published once hashed: RoundFinisher)
        ratio = f"{record['compression']:,.0f}x" if record["compression"] else "-"
        val = f" | val {record['val_loss']:.4f}" if record["val_loss"] is not None else ""
        # Which live trainers nobody can dial (the coordinator's view: their heartbeats' addresses).
        clients = sum(1 for m in self.session.view.trainers() if is_client(m.address))
        reach = f" ({clients} in client mode)" if clients else ""
        self.log(
            f"round {record['round']:4d} | loss {record['loss']:.4f}{val}"
            f" | {record['tokens_per_s']:,.0f} tok/s"
            f" | sent {record['bytes_sent'] / 1e6:.2f} MB | {ratio} less than ddp | peers {record['peers']}{reach}"
            f" | {'coordinator ok' if self.session.coordinator_up else 'coordinator DOWN'} | hash {record['hash'][:12]}"
        )
