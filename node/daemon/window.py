"""One window of inner steps: what `NodeTrainer.run_window` trains between two rounds.

One *window* is H inner steps (sync.inner_steps); a window ends with the run's sync point for
DiLoCo (and for Streaming DiLoCo the last fragment of the window is launched; it lands tau steps
into the next window). Progress is committed per window, for the tokens the window consumed: it
trains on the coordinator's leased shards (`use_lease`; a shard that runs out is closed and the
next one leased mid-window, committed with the window's round), and a window whose data runs out
at a run's end ticks its remaining steps dry (`_dry_steps`).

With sync.round_budget = "speed" (optim/budget.py) a window is this node's share of the group's
K*H steps, from its measured compute speed and its peers' (their DHT records); its pseudo-gradient
carries the window's tokens as its weight. The schedule's step still advances by H a window on
every member (the lr schedule, the run's end and the shared state's counters stay the group's).
With sync.fill_wait on as well, a member whose share is done does not idle while the round's
exchange is in flight (it waits for the slowest member, then for the all-reduce): it trains on
(`_fill`), and those steps are *carried* into the next window (`Carry`): StreamingDiLoCo.land
keeps their drift on top of the new global copy, and their tokens are committed, and weigh, with
the next window's round, the round whose pseudo-gradient holds them. The window ends when its
round lands.

`WindowLoop` is one side of `NodeTrainer` (node/daemon/training.py builds the model, the inner
optimizer and the sync algorithm it steps).
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from murmur.node.daemon.ranks import LocalRanks
from murmur.node.daemon.wait_meter import WaitMeter
from murmur.node.daemon.window_types import Carry, LeaseSource, LeaseView, Segment, TrainingError, WindowResult
from murmur.node.model.data import BatchLoader, Dataset, Position
from murmur.node.train.step import InnerStep
from murmur.optim.budget import SpeedMeter, member_steps
from murmur.optim.diloco import StreamingDiLoCo
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.runconfig import RunConfig

# Inner steps a GPU node keeps queued ahead of the device (`NodeTrainer._keep_queue`): about 0.1 s
# of the base preset's steps on an H200. `murmur train` waits only every tenth step.
QUEUED_STEPS = 3


class WindowLoop:
    """The inner-step loop of a `NodeTrainer` (whose __init__ sets every attribute named here)."""

    cfg: RunConfig
    dataset: Dataset
    device: torch.device
    ranks: LocalRanks | None
    model: torch.nn.Module
    meter: WaitMeter
    sync: SyncAlgorithm
    inner: InnerStep
    seq_len: int
    batch: int
    span: int
    h: int
    step: int
    round: int
    lease: LeaseView | None
    loader: BatchLoader | None
    speed: SpeedMeter
    group_rates: Callable[[], Iterable[float]]
    after_step: Callable[[float], None] | None
    carry: Carry
    _last_loss: float
    _filled_steps: int
    _fill_seconds: float
    _land_wait: float
    _fill_leasing: float
    _eval_copy: torch.nn.Module | None

    # -- data ------------------------------------------------------------------------------------

    def use_lease(self, lease: LeaseView) -> None:
        if not 0 <= lease.shard_id < self.dataset.num_shards:
            raise TrainingError(
                f"the coordinator leased shard {lease.shard_id} but the local dataset has "
                f"{self.dataset.num_shards} shards: --data must be the run's dataset"
            )
        if self.dataset.shard_size(lease.shard_id) != lease.end_offset:
            raise TrainingError(
                f"shard {lease.shard_id} has {self.dataset.shard_size(lease.shard_id)} tokens here but "
                f"{lease.end_offset} in the run: --data must be the run's dataset"
            )
        self.lease = lease
        self.loader = BatchLoader(
            self.dataset,
            [lease.shard_id],
            self.batch,
            self.seq_len,
            position=Position(lease.shard_id, lease.start_offset),
            cycle=False,
        )

    def _fits(self) -> bool:
        assert self.lease is not None and self.loader is not None
        return self.loader.position.offset + self.span + 1 <= self.lease.end_offset

    # -- one window ------------------------------------------------------------------------------

    def _inner_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """One step at schedule step ``step``, queued on the device; returns its loss (not waited for)."""
        if self.ranks is not None:  # the other ranks take their slices (and this rank's weights)
            x, y = self.ranks.begin_step(self.model, x, y)
        # DDP all-reduces in it, DeMo all-gathers, DiLoCo launches or applies an exchange.
        return self.inner(step, self.cfg.train.steps, x, y).loss

    def by_speed(self) -> bool:
        return self.cfg.sync.round_budget == "speed" and isinstance(self.sync, StreamingDiLoCo)

    def window_steps(self) -> int:
        """This node's inner steps in the next window: H, or with round_budget = "speed" its share
        of the group's K*H by speed; then the window's update weighs its tokens."""
        if not self.by_speed():
            return self.h
        assert isinstance(self.sync, StreamingDiLoCo)
        n = member_steps(self.h, self.speed.rate, self.group_rates(), self.cfg.sync.max_step_ratio)
        # With carried steps the pseudo-gradient holds both: together within the share's bound.
        n = min(n, max(1, self._most_steps() - len(self.carry.losses)))
        n = self.sync.plan_window(n)
        # The carried steps are in this window's pseudo-gradient too: they weigh with it.
        self.sync.weight = float((n + len(self.carry.losses)) * self.span)
        return n

    def _most_steps(self) -> int:
        """The most inner steps one window's pseudo-gradient may hold (optim/budget.py's clip)."""
        return int(self.h * self.cfg.sync.max_step_ratio)

    def fills(self) -> bool:
        return isinstance(self.sync, StreamingDiLoCo) and self.sync.fill

    def drop_carry(self) -> None:
        """Forget the carried steps (their lease was dropped: their tokens are trained again): the
        local weights go back to the global copy."""
        if self.carry.losses and isinstance(self.sync, StreamingDiLoCo) and not self.sync.in_flight:
            self.sync.locals_to_global()
        self.carry = Carry()

    def eval_model(self) -> torch.nn.Module:
        """The model to evaluate after a round: the global one. With carried steps the local
        weights are ahead of it, so a copy holds the global weights."""
        if not self.fills():
            return self.model
        if self._eval_copy is None:
            self._eval_copy = copy.deepcopy(self.model)
        with torch.no_grad():
            for p, t in zip(self._eval_copy.parameters(), self.sync.eval_tensors(), strict=True):
                p.copy_(t)
        return self._eval_copy

    def _keep_queue(self, queued: deque[torch.cuda.Event]) -> None:
        """After a step is queued on a GPU: wait until no more than QUEUED_STEPS steps are queued
        ahead of the device. The training thread loads batches and launches kernels while the GPU
        runs what is queued; a node's other threads (the exchange, the round finisher, gRPC) take
        the GIL and CUDA's context lock at times (a page-locked allocation held kernel launches
        for 66 ms in a profile on the H200), and a queue of several steps lets the GPU run through
        such a stall instead of idling in it. On the CPU, steps run as they are called."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        queued.append(done)
        while len(queued) > QUEUED_STEPS:
            queued.popleft().synchronize()

    def run_window(self, next_lease: LeaseSource, stop: Callable[[], bool]) -> WindowResult:
        """H inner steps on the leased data (taking new leases as shards run out). Its compute
        time is its wall time less its waits for leases and for the exchange (on a GPU the steps
        queued ahead run through such a wait, so the figure is low by up to QUEUED_STEPS steps)."""
        t0, waited0, started = time.perf_counter(), self.meter.waited_s, time.time()
        arrived = started
        carried, self.carry = self.carry, Carry()
        losses: list[torch.Tensor] = list(carried.losses)
        leasing = 0.0
        segments: list[Segment] = list(carried.segments)
        timed = 0  # steps run (and timed) in this call
        stopped = dry = False
        queued: deque[torch.cuda.Event] = deque()
        n, base = self.window_steps(), self.step
        stepping = 0.0  # the steps' own time (the speed: without the window's fixed costs)
        for j in range(n):
            if stop():
                stopped = True
                break
            while self.lease is None or not self._fits():
                done = self._close_segment(segments) if self.lease is not None else None
                if done is not None and done not in segments:
                    segments.append(done)  # its tail only (nothing trained on it in this window)
                # A shard that ran out is committed with the window's round, like the rest: its
                # tokens count only if the round completes (the coordinator keeps it held).
                t_lease = time.perf_counter()
                lease = next_lease(done)
                ends = done is not None and self.can_end_dry() and bool(losses or math.isfinite(self._last_loss))
                if lease is None and done is not None and not ends and not stop():
                    lease = next_lease(None)  # no step and no loss to end the window with: wait for a shard
                leasing += time.perf_counter() - t_lease
                if lease is None:
                    # No free shard and this window's ran out (a run's last shards): its remaining
                    # steps are dry. Else (None without such an end) the node stops.
                    dry = ends and not stop()
                    stopped = not dry
                    break
                self.use_lease(lease)
            if stopped:
                break
            if dry:
                self._dry_steps(base, j, n, len(losses))
                break
            assert self.loader is not None and self.lease is not None
            if not segments or segments[-1].lease.lease_id != self.lease.lease_id:
                offset = self.loader.position.offset
                segments.append(Segment(self.lease, offset, offset))
            x, y = next(self.loader)
            segments[-1].end = self.loader.position.offset
            t_step, w_step = time.perf_counter(), self.meter.waited_s
            # Step j of n is at schedule step base + j*H/n: the same lr at the same share of the
            # round on every member, whatever its count.
            losses.append(self._inner_step(x, y, base + j * self.h // n))
            arrived = time.time() - (self.meter.waited_s - w_step)
            self.step = base + (j + 1) * self.h // n
            if self.after_step is not None:  # told the step's compute, not its wait for the round
                self.after_step(time.perf_counter() - t_step - (self.meter.waited_s - w_step))
            self._keep_queue(queued)
            stepping += time.perf_counter() - t_step
            timed += 1
        if stopped:
            if queued:
                queued[-1].synchronize()
            seconds, waited = time.perf_counter() - t0, self.meter.waited_s - waited0
            return WindowResult(self.round, len(losses), math.nan, 0, seconds, seconds - leasing - waited, [], True)
        closed = None
        if self.lease is not None and not self._fits():
            closed = self._close_segment(segments)  # runs out exactly at the window's end: commit with it
        if self.fills():
            arrived = time.time()
            filled = self._fill(stop, queued, next_lease, closed)
            leasing += self._fill_leasing
            if not filled:  # a stop: nothing of this window is committed
                seconds, waited = time.perf_counter() - t0, self.meter.waited_s - waited0
                return WindowResult(self.round, len(losses), math.nan, 0, seconds, seconds - leasing - waited, [],
                                    True, started=started, arrived=arrived)
        # waits for the window's last step; a dry window of no step (a shard's tail only, taken
        # over at a run's end) reports the last window's loss
        mean = torch.stack(losses).float().mean().item() if losses else self._last_loss
        if not math.isfinite(mean):
            raise TrainingError(f"loss became {mean} in round {self.round}: lower optim.lr")
        self._last_loss = mean
        self.round += 1
        tokens = sum(s.end - s.start for s in segments)
        seconds, waited = time.perf_counter() - t0, self.meter.waited_s - waited0
        # Per step, not per window: a window's fixed costs (the loss read, the round's bookkeeping)
        # spread over a small share would make a slow member look slower and shrink its next share
        # again. The exchange waits inside the steps (DiLoCo's last one) are not speed.
        # In steps, not tokens: the shares even out the members' wall times, and a node of local
        # ranks (N times the rows a step) takes a step about as long as one rank alone.
        self.speed.add(timed + self._filled_steps, stepping + self._fill_seconds - (waited - self._land_wait))
        return WindowResult(
            self.round, timed, mean, tokens, seconds, seconds - leasing - waited, segments,
            exchange_wait_seconds=waited, started=started, arrived=arrived, filled=len(self.carry.losses),
            carried=len(carried.losses), carried_shards=[seg.lease.shard_id for seg in carried.segments],
        )

    def can_end_dry(self) -> bool:
        """Whether a window may end before its H steps when its data runs out (a run's last shards):
        DiLoCo's and Streaming DiLoCo's, whose sync happens at given steps of the window and can be
        ticked without a step. Not DDP or DeMo (their exchange is every step's gradient), nor a node
        of local ranks (the other ranks take every step's slices)."""
        return self.ranks is None and isinstance(self.sync, StreamingDiLoCo) and not self.sync.replaces_optimizer

    def _dry_steps(self, base: int, first: int, n: int, trained: int) -> None:
        """Steps ``first``..n-1 of the window without data: no forward, backward or AdamW step, but
        the sync hears of each, so the window's exchanges launch at the same steps as its peers'
        (same rounds, same members). Where pseudo-gradients weigh their tokens (round_budget =
        "speed"), this one weighs the steps really trained."""
        if self.by_speed():
            self.sync.weight = float(trained * self.span)
        for j in range(first, n):
            self.sync.after_optimizer_step(base + j * self.h // n)
            self.step = base + (j + 1) * self.h // n

    def _fill(self, stop: Callable[[], bool], queued: deque[torch.cuda.Event], next_lease: LeaseSource,
              closed: Segment | None) -> bool:
        """While the window's round is in flight: train on the leased data (the next window's
        steps, `Carry`), then land the round. A shard that runs out meanwhile is closed in the
        carry and the next one leased, as a window does (``closed``: the window's own last shard,
        run out at its end and committed with it, which the lease request names as exhausted). A
        lease not granted at once while the round has landed ends the filling: the next window
        asks again. False: a stop came first (the round is left in flight; the window is not
        committed)."""
        assert isinstance(self.sync, StreamingDiLoCo)
        landing = self.sync.landing()
        self._filled_steps, self._fill_seconds, self._land_wait, self._fill_leasing = 0, 0.0, 0.0, 0.0
        # Leave room for the next window's share, as the speeds say now: the carried steps and the
        # share stay within the bound together (a member that filled while the speeds were not
        # known yet, the first rounds, trained 4H beside a 4x slower one's H). Cutting the share
        # instead kept a member that had been slow on a small share after it was fast again: it
        # came early, filled, and its share was cut again.
        nxt = member_steps(self.h, self.speed.rate, self.group_rates(), self.cfg.sync.max_step_ratio)
        most = self._most_steps() - nxt
        while landing is not None and not landing.done() and len(self.carry.losses) < most:
            if stop():
                return False
            if self.lease is None or self.loader is None or not self._fits():
                # The shard ran out: its segment (the carry's, else the window's ``closed``) is
                # committed with the round that holds its steps, and stays held meanwhile.
                if self.lease is None:  # the window's last shard, in the window's segments
                    done, closed = closed, None
                else:
                    done = self._close_segment(self.carry.segments)
                    if done is not None and all(done is not seg for seg in self.carry.segments):
                        self.carry.segments.append(done)  # its tail only (no step on it while filling)
                t_lease = time.perf_counter()
                lease = next_lease(done, landing.done)
                self._fill_leasing += time.perf_counter() - t_lease
                if lease is None:
                    if stop():
                        return False
                    break  # the round landed while no shard was free: the next window asks again
                self.use_lease(lease)
                continue
            if not self.carry.segments or self.carry.segments[-1].lease.lease_id != self.lease.lease_id:
                offset = self.loader.position.offset
                self.carry.segments.append(Segment(self.lease, offset, offset))
            x, y = next(self.loader)
            self.carry.segments[-1].end = self.loader.position.offset
            t_step, w_step = time.perf_counter(), self.meter.waited_s
            # At the next window's first schedule step (the schedule advances by H a window).
            self.carry.losses.append(self._inner_step(x, y, self.step))
            if self.after_step is not None:
                self.after_step(time.perf_counter() - t_step - (self.meter.waited_s - w_step))
            self._keep_queue(queued)
            self._filled_steps += 1
            self._fill_seconds += time.perf_counter() - t_step
        waited0 = self.meter.waited_s
        self.sync.land()
        self._land_wait = self.meter.waited_s - waited0
        return True

    def _close_segment(self, segments: list[Segment]) -> Segment | None:
        """The shard has no full batch left: its segment runs to the shard's end (the tail shorter
        than one batch is never trained; committing it marks the shard done). Returns it."""
        assert self.lease is not None
        seg = None
        if segments and segments[-1].lease.lease_id == self.lease.lease_id:
            seg = segments[-1]
        elif self.loader is not None and self.loader.position.offset < self.lease.end_offset:
            # Nothing trained on it in this window (it ran out at the last window's end).
            offset = self.loader.position.offset
            seg = Segment(self.lease, offset, offset)
        if seg is not None:
            seg.end, seg.exhausted = self.lease.end_offset, True
        self.lease, self.loader = None, None
        return seg

    def finish(self) -> None:
        """Apply what is still in flight (Streaming DiLoCo) before a final evaluation."""
        self.sync.finish()
