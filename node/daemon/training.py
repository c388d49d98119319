"""The node's training side: one replica, its inner optimizer and its sync algorithm.

It runs in the daemon's training thread (node/daemon/training_thread.py; node/daemon/node.py owns
the asyncio loop). The inner step is every engine's (node/train/step.py), with the node's extras:
the data comes from the shard the coordinator leased, compute time is measured apart from time
spent waiting for the exchange, and the whole state (model, inner optimizer, global copy, outer momentum,
round counters; the codec's error-feedback residual in the checkpoint, which is this node's alone) can be
saved, restored, hashed and handed to a joiner.

One *window* is H inner steps (sync.inner_steps); a window ends with the run's sync point for
DiLoCo (and for Streaming DiLoCo the last fragment of the window is launched; it lands tau steps
into the next window). Progress is committed per window, for the tokens the window consumed.

With sync.round_budget = "speed" (optim/budget.py) a window is this node's share of the group's
K*H steps, from its measured compute speed and its peers' (their DHT records); its pseudo-gradient
carries the window's tokens as its weight. The schedule's step still advances by H a window on
every member (the lr schedule, the run's end and the shared state's counters stay the group's).
With sync.fill_wait on as well, a member whose share is done does not idle while the round's
exchange is in flight (it waits for the slowest member, then for the all-reduce): it trains on,
and those steps are *carried* into the next window (`Carry`): StreamingDiLoCo.land keeps their
drift on top of the new global copy, and their tokens are committed, and weigh, with the next
window's round, the round whose pseudo-gradient holds them. The window ends when its round lands.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from murmur.errors import MurmurError
from murmur.node.daemon import snapshot
from murmur.node.daemon.ranks import LocalRanks, RankedSync
from murmur.node.model.data import BatchLoader, Dataset, Position
from murmur.node.train.build import build_model_from_config
from murmur.node.train.step import InnerStep, clip_grad_norm
from murmur.optim.budget import SpeedMeter, member_steps
from murmur.optim.codecs import Codec
from murmur.optim.demo import DeMo
from murmur.optim.diloco import StreamingDiLoCo
from murmur.optim.exchange import Exchange, ExchangeError
from murmur.optim.factory import build_sync
from murmur.optim.inner import make_inner_optimizer
from murmur.protocol.runconfig import RunConfig
from murmur.protocol.wire import tensors_hash

# Inner steps a GPU node keeps queued ahead of the device (`NodeTrainer._keep_queue`): about 0.1 s
# of the base preset's steps on an H200. `murmur train` waits only every tenth step.
QUEUED_STEPS = 3
GLOBAL_PREFIXES = ("global/", "param/")  # the names of the replicated tensors in `shared_tensors`


def shared_state_hash(shared: list[tuple[str, torch.Tensor]]) -> str:
    """`NodeTrainer.global_hash`, read from `shared_tensors`' copies instead of the live state."""
    return tensors_hash((n, t) for n, t in shared if n.startswith(GLOBAL_PREFIXES)).hex()


class TrainingError(MurmurError):
    pass


@dataclass(slots=True)
class LeaseView:
    """The part of a coordinator lease the training thread needs."""

    lease_id: str
    shard_id: int
    start_offset: int  # the shard's committed offset when leased: training starts here
    end_offset: int  # the shard's size in tokens


@dataclass(slots=True)
class Segment:
    """Tokens [start, end) of one lease consumed within the current window."""

    lease: LeaseView
    start: int
    end: int
    exhausted: bool = False  # the shard has no full batch left: commit up to its end


@dataclass(slots=True)
class WindowResult:
    round: int
    steps: int  # this window's share (the steps it ran; with sync.fill_wait, ``carried`` come on top)
    loss: float
    tokens: int
    seconds: float
    compute_seconds: float
    segments: list[Segment] = field(default_factory=list)
    stopped: bool = False  # the window ended early because a stop was asked for
    exchange_wait_seconds: float = 0.0  # of ``seconds``: training blocked on the exchange
    started: float = 0.0  # wall clock (time.time()) at the window's start
    arrived: float = 0.0  # wall clock when its last step had computed (before any wait for the round)
    filled: int = 0  # sync.fill_wait: steps trained while its round was in flight (carried to the next)
    carried: int = 0  # sync.fill_wait: the last window's filled steps, committed with this one (not in ``steps``)
    carried_shards: list[int] = field(default_factory=list)  # the shards those carried steps trained on


@dataclass(slots=True)
class Carry:
    """Steps trained while a window's round was in flight (sync.fill_wait): the next window's."""

    segments: list[Segment] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


class _MeteredFuture(Future):
    """A future that adds the time its caller spends blocked in ``result()`` to a meter."""

    def __init__(self, meter: WaitMeter) -> None:
        super().__init__()
        self._meter = meter

    def result(self, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._meter.waited_s += time.perf_counter() - t0


class WaitMeter(Exchange):
    """Wraps the run's exchange and measures how long training waits for it: compute time is a
    step's time minus this (the algorithms wait inside their hooks, DeMo inside its optimizer)."""

    def __init__(self, inner: Exchange) -> None:
        self.inner = inner
        self.waited_s = 0.0
        self._pending: set[Future] = set()
        self._aborted = ""

    def abort(self, reason: str) -> None:
        """Fail every pending and later call at once (a stop must not sit out a round timeout)."""
        self._aborted = reason
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(ExchangeError(reason))

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def _wrap(self, fut: Future) -> Future:
        out = _MeteredFuture(self)
        if self._aborted:
            out.set_exception(ExchangeError(self._aborted))
            return out
        self._pending.add(out)

        def done(f: Future) -> None:
            self._pending.discard(out)
            if out.done():  # aborted meanwhile
                return
            err = f.exception() if not f.cancelled() else ExchangeError("the exchange call was cancelled")
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(f.result())

        fut.add_done_callback(done)
        return out

    def all_reduce(self, tensors, *, round_id: int, key: str = "", weight: float = 1.0):  # noqa: ANN001
        return self._wrap(self.inner.all_reduce(tensors, round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire, *, round_id: int, key: str = ""):  # noqa: ANN001
        return self._wrap(self.inner.all_gather(wire, round_id=round_id, key=key))

    def close(self) -> None:
        self.inner.close()


class LeaseSource(Protocol):
    """Blocks until the coordinator grants a lease; None when the node should stop instead. It gets
    the segment of the shard that just ran out (or None): that lease stays held, exhausted, and is
    committed with the window whose steps trained it (the coordinator would otherwise hand it back
    until its shard is done). Given such a segment, and no other shard free, it may also return
    None at once without a stop (``can_end_dry``): the window then ends dry (`_dry_steps`).
    ``give_up`` (sync.fill_wait's lease while a round is in flight): also None once it says so
    after a refusal, rather than waiting for a shard to come free."""

    def __call__(self, done: Segment | None, give_up: Callable[[], bool] | None = None) -> LeaseView | None: ...


class NodeTrainer:
    def __init__(
        self,
        cfg: RunConfig,
        dataset: Dataset,
        device: torch.device,
        exchange: Exchange,
        *,
        round_timeout_s: float,
        ranks: LocalRanks | None = None,
    ) -> None:
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.ranks = ranks  # local ranks beside this one (node/daemon/ranks.py): data parallel inside the node
        torch.manual_seed(cfg.seed)
        # Same seed, same initial weights on every node (node/model/transformer.py draws them on the CPU).
        self.model = build_model_from_config(cfg, dataset.vocab_size, device)
        self.opt = make_inner_optimizer(self.model, cfg.optim)
        self.meter = WaitMeter(exchange)
        self.sync = build_sync(
            cfg.sync,
            list(self.model.named_parameters()),
            self.meter,
            weight_decay=cfg.optim.weight_decay,
            round_timeout_s=round_timeout_s,
        )
        hooks = RankedSync(self.sync, ranks, self.model) if ranks is not None else self.sync
        self.inner = InnerStep(self.model, self.opt, cfg, device, clip_grad_norm(self.model), hooks)
        self.seq_len = self.model.cfg.seq_len
        # With local ranks the node's batch is train.batch_size rows per rank, all from its lease.
        self.batch = cfg.train.batch_size * (ranks.world if ranks is not None else 1)
        self.span = self.batch * self.seq_len
        self.h = cfg.sync.inner_steps
        self.step = 0  # inner steps done (drives the lr schedule and DeMo's round ids)
        self.round = 0  # windows done
        self._last_loss = math.nan  # the last window's mean loss (what a dry window of no step reports)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.lease: LeaseView | None = None
        self.loader: BatchLoader | None = None
        # sync.round_budget = "speed": this node's compute speed (inner steps/s) and the last round's
        # members' (the training thread sets the source); the window's length comes from both.
        self.speed = SpeedMeter()
        self.group_rates: Callable[[], Iterable[float]] = tuple
        self.after_step: Callable[[float], None] | None = None  # --fault slow: told each step's seconds
        self.carry = Carry()  # sync.fill_wait: steps trained while the last round was in flight
        # The last `_fill`'s steps, their time, its wait for the round to land after them, and its
        # waits for leases (a shard that ran out while it filled).
        self._filled_steps, self._fill_seconds, self._land_wait, self._fill_leasing = 0, 0.0, 0.0, 0.0
        # With local ranks too: rank 0 alone decides to fill and lands the round, and the other
        # ranks follow it step by step (every step is one collective that rank 0 starts, from its
        # weights), so all of them fill the same steps (docs/algorithms.md).
        if self.by_speed() and cfg.sync.fill_wait:
            self.sync.fill = True
        self._eval_copy: torch.nn.Module | None = None

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

    # -- the global state --------------------------------------------------------------------------

    def global_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The replicated state: identical on every member after a round (hashed, handed to joiners)."""
        if isinstance(self.sync, StreamingDiLoCo):
            out = []
            for frag in self.sync.fragments:
                for j, g in zip(frag.members, frag.globals_, strict=True):
                    out.append((f"global/{self.sync.names[j]}", g))
            return out
        return [(f"param/{n}", p.detach()) for n, p in self.model.named_parameters()]

    def global_hash(self) -> str:
        return tensors_hash((n, t.detach().cpu()) for n, t in self.global_tensors()).hex()

    def shared_state(self, *, on_device: bool = False) -> dict[str, Any]:
        """What a joiner needs to take part from the next round: global copy, outer momentum,
        counters. A copy, made once: the next window and outer step do not move it. On the CPU,
        or with ``on_device`` on the GPU for the round finisher to move (node/daemon/snapshot.py)."""
        state: dict[str, Any] = {
            "step": self.step,
            "round": self.round,
            "tensors": snapshot.take(dict(self.global_tensors()), on_device=on_device),
        }
        if isinstance(self.sync, StreamingDiLoCo):
            state["fragments"] = [
                {"rounds": f.rounds, "outer": snapshot.take(f.outer.state_dict(), on_device=on_device)}
                for f in self.sync.fragments
            ]
        return state

    def snapshot_on_device(self) -> bool:
        """Whether the GPU has room for the snapshots between windows (a checkpoint's worth:
        model, optimizer, global copy and outer momentum), so the training thread need not wait
        for their copies to the CPU."""
        if self.device.type != "cuda":
            return False
        size = snapshot.nbytes([self.model.state_dict(), self.opt.state_dict(), self.global_tensors()])
        if isinstance(self.sync, StreamingDiLoCo):
            size += snapshot.nbytes([f.outer.state_dict() for f in self.sync.fragments])
        return snapshot.room_on_device(self.device, size)

    @torch.no_grad()
    def load_shared_state(self, state: dict[str, Any]) -> None:
        tensors = state["tensors"]
        mine = dict(self.global_tensors())
        if set(tensors) != set(mine):
            raise TrainingError("the fetched state names other tensors than this node's model holds")
        for name, t in mine.items():
            src = tensors[name]
            if src.shape != t.shape:
                raise TrainingError(
                    f"fetched tensor {name} has shape {tuple(src.shape)}, expected {tuple(t.shape)}"
                )
            t.copy_(src.to(device=t.device, dtype=t.dtype))
        if isinstance(self.sync, StreamingDiLoCo):
            for frag, saved in zip(self.sync.fragments, state["fragments"], strict=True):
                frag.rounds = int(saved["rounds"])
                frag.outer.load_state_dict(saved["outer"])
            self.sync.locals_to_global()
            self.sync.in_flight.clear()
        self.carry = Carry()  # the local weights are the global copy again: nothing carried
        self.step, self.round = int(state["step"]), int(state["round"])

    def renumber(self, round_id: int) -> None:
        """Go on from this state as round ``round_id``: the run got that far, and every holder of
        the rounds between is gone (node/daemon/training_thread.py's restore). The counters move as if those
        rounds were trained here (steps for the schedule and DeMo's round ids, the fragments'
        exchange round ids), so no round number of the run is ever used for two states."""
        gap = round_id - self.round
        if gap <= 0:
            return
        self.round, self.step = round_id, self.step + gap * self.h
        if isinstance(self.sync, StreamingDiLoCo):
            for frag in self.sync.fragments:
                frag.rounds += gap

    # -- the shared state as named tensors (what peers publish and joiners fetch) ------------------

    def shared_tensors(self, state: dict[str, Any] | None = None) -> list[tuple[str, torch.Tensor]]:
        """The shared state (``state``, a `shared_state` just taken, or a new one) flattened to named
        CPU tensors, in a fixed order (its hash is the state's)."""
        if state is None:
            state = self.shared_state()
        out = list(state["tensors"].items())
        counters = [state["step"], state["round"]]
        for i, frag in enumerate(state.get("fragments", [])):
            counters.append(frag["rounds"])
            for j, entry in sorted(frag["outer"]["state"].items()):
                buf = entry.get("momentum_buffer")
                if buf is not None:
                    out.append((f"outer/{i}/{j}", buf))  # shared_state's copy, not the live buffer
        out.append(("counters", torch.tensor(counters, dtype=torch.int64)))
        return out

    def load_shared_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `shared_tensors` (fetched from peers, already verified by hash)."""
        if "counters" not in tensors:
            raise TrainingError("the fetched state has no counters")
        counters = [int(v) for v in tensors["counters"].tolist()]
        state: dict[str, Any] = {
            "step": counters[0],
            "round": counters[1],
            "tensors": {n: t for n, t in tensors.items() if n.startswith(GLOBAL_PREFIXES)},
        }
        if isinstance(self.sync, StreamingDiLoCo):
            if len(counters) != 2 + len(self.sync.fragments):
                raise TrainingError("the fetched state has another number of fragments than this run")
            frags = []
            for i, frag in enumerate(self.sync.fragments):
                outer = frag.outer.state_dict()
                outer["state"] = {}
                for j in range(len(frag.globals_)):
                    buf = tensors.get(f"outer/{i}/{j}")
                    if buf is not None:
                        outer["state"][j] = {"momentum_buffer": buf.clone()}
                frags.append({"rounds": counters[2 + i], "outer": outer})
            state["fragments"] = frags
        self.load_shared_state(state)

    # -- local checkpoint --------------------------------------------------------------------------

    def state_dict(self, shared: dict[str, Any] | None = None, *, on_device: bool = False) -> dict[str, Any]:
        """The local checkpoint, a copy the next window does not move (``shared``: a
        `shared_state` just taken, so the global state is copied once; ``on_device`` as there)."""
        state = {
            "config": self.cfg.to_dict(),
            "model": snapshot.take(self.model.state_dict(), on_device=on_device),
            "optimizer": snapshot.take(self.opt.state_dict(), on_device=on_device),
            "shared": shared if shared is not None else self.shared_state(on_device=on_device),
            "bytes": self.sync.bytes.to_dict(),
        }
        if isinstance(self.sync, DeMo):
            state["demo_momentum"] = snapshot.take(list(self.sync.momentum), on_device=on_device)
        codec = self.codec()
        if codec is not None:  # error feedback: what the codec has not sent yet is this node's alone
            state["codec"] = snapshot.take(codec.state_dict(), on_device=on_device)
        return state

    def codec(self) -> Codec | None:
        """The exchange's codec (its error-feedback residuals are this node's state), found through
        the wrappers around the exchange (`WaitMeter`, the data plane's member tracker)."""
        ex: Any = self.meter
        while ex is not None and not isinstance(getattr(ex, "codec", None), Codec):
            ex = getattr(ex, "inner", None)
        return ex.codec if ex is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config") != self.cfg.to_dict():
            raise TrainingError("the local checkpoint belongs to another run configuration")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.load_shared_state(state["shared"])
        # load_shared_state copied the global copy into the model; the checkpoint was written
        # right after a round, when the local weights equal the global ones (DiLoCo) or hold the
        # mix (Streaming, alpha > 0), so restore the saved local weights on top.
        self.model.load_state_dict(state["model"])
        if isinstance(self.sync, DeMo) and "demo_momentum" in state:
            for m, saved in zip(self.sync.momentum, state["demo_momentum"], strict=True):
                m.copy_(saved.to(m.device))
        codec = self.codec()
        if codec is not None and "codec" in state:
            codec.load_state_dict({k: v.to("cpu") for k, v in state["codec"].items()})
        b = state.get("bytes") or {}
        self.sync.bytes.sent.update(b.get("sent", {}))
        self.sync.bytes.received.update(b.get("received", {}))
        self.sync.bytes.rounds = int(b.get("rounds", 0))
