"""Within-stage sync: the peers of one stage keep its weights together with DiLoCo's outer step,
beside the compute, never in its way.

Stage-mates step at different rates (the router gives the faster one more microbatches), so a
round cannot wait for "the H-th step" of a peer. **Rounds count in the run's samples**
(``pipeline.sync_every_samples``, N): a round starts on every peer serving s once the run's
ledger passes the next multiple of N samples, and its id is that multiple. Every committed sample
went through every stage, so the ledger (tokens committed // seq_len, as the drivers tell it with
each backward and the peer polls it from the coordinator: node/pipeline/schedule.py) counts what
the stage trained, the same on every mate, and the mates agree on the round's id without a message.
The drift between two rounds is then bounded in samples (what decides how far mates drift apart,
as DiLoCo's H does) whatever the hardware: on the clock (every 30 s) the benchmark's 960 samples
got one round on a quiet machine and ten on a loaded one, and the two-peer loss gap measured the
machine as much as the pipeline (5.21% against 1.21%). The rules (`due_round`):

- Mates hear the ledger at slightly different moments (a backward's total, a poll every 0.5 s): a
  round starts on each when it hears the multiple passed, and the exchange's rendezvous waits for
  the others within the round's deadline.
- A ledger that jumps several multiples at once (a round that outlasted them, a late poll) gives a
  round at each of them in turn, one after another: every mate walks the same ids, whatever moment
  it heard the total at. Skipping to the latest multiple instead let two mates that heard the total
  at different moments start different rounds (16 on one, 32 on the other), each waiting out the
  deadline for the other: under load the first real-process test had no round complete at all.
- A peer that becomes the stage (a start, a join, a move, a restart) counts from the multiple the
  ledger is past when it does (the coordinator's view gives the total before the peer serves): its
  first round is the next multiple, the one its mates run next.
- A ledger that stood still for ``sync_every_s`` with samples past the last round (the drivers
  finished, paused, or wait for a refill) gives one round at that total, so mates that trained
  apart do not stay apart until training resumes; its id, the total, lies between two multiples.
  A stage nobody trained since its last round (a ledger that did not move) makes no round at all.
  (A peer that joins a still ledger whose mates ran that round already runs it alone once: it
  fails at its deadline and changes nothing.)
- ``sync_every_s`` stays the round's time scale (its deadline is 3/4 of it, the look at the mates'
  outer states 1/4, its parts start within it) and the stillness above. It is no floor between
  rounds: a floor in seconds would make the drift depend on the machine's speed again, and rounds
  run one at a time (a network slower than the training makes them back to back, behind the
  ledger). ``sync_every_samples = 0`` keeps rounds on the clock, round r
  at ``r * sync_every_s`` of Unix time.

A round runs like this:

1. Between two microbatches (under the worker's lock) the peer takes a snapshot of its weights
   and the samples it trained since the last round.
2. On the event loop, off the compute: the pseudo-gradient ``anchor - snapshot`` goes through the
   run's exchange (node/exchange/: the run's codec and aggregator, weighted by those samples,
   members from the coordinator's view of the stage, key ``stage/<s>``), while the worker keeps
   serving microbatches.
3. The run's outer optimizer (SGD with ``sync.outer_lr``, ``sync.outer_momentum``,
   ``sync.nesterov``) steps the anchor with the mean; the weights become
   ``anchor + (weights now - snapshot)``: what was trained during the round is kept on top.
   A mean that is exactly zero (no mate's weights moved since the last round: nobody trained
   the stage) makes no outer step at all: the momentum alone would otherwise move the weights
   of an idle stage round after round. The weights stay bit for bit; the round still counts.
   (A codec with error feedback may send a residual of earlier training in an idle round: that
   is trained weight, and it is stepped.)

**Parts.** Steps 1-3 run part by part (node/pipeline/sync_buckets.py): the stage's tensors cut
into parts of at most ``pipeline.sync_bucket_mb`` MiB, one after the other, each its own exchange
call under the round (key ``<key>/part<i>``, the members the round started with), so every copy a
round makes below is a part's (B), not the stage's. The outer step is element by element, so the
parts give what one exchange of the whole stage gives on the same inputs
(tests/test_pipeline_sync_buckets.py). A part starts only within a period of the round's start. Measured in
one process (two mates of an 82 MiB stage, plain averaging): a round peaked at 3.7-3.8 W a mate
over the process's level before it as one exchange, 1.0-1.1 W in parts of 16 MiB, 0.6 W in parts
of 8 MiB.

**What a round holds** (W: the stage's fp32 weights once, B: a part; docs/pipeline.md says the same):

- *Plain averaging* (`averages_weights`: outer lr 1, no momentum, the lossless fp32 codec without
  error feedback, the plain mean; configs/pipeline-cpu.toml ships it). The outer step is then the
  mates' weighted mean itself (``anchor - mean(anchor - w_i) = mean(w_i)``), so the round averages
  the snapshots of the weights and keeps nothing between rounds: no anchor, no momentum, nothing
  published. A part holds its snapshot, the exchange's flat copy of it and the result (3 B), and
  the exchange's chunks in transit; the result stays published for late mates until the next part
  completes with every member (the last part's: a round deadline). With one more number in the
  exchange, the samples each mate trained since
  its last completed round, the mates see together whether anybody trained: if nobody did, the
  round changes nothing (the idle rule below), bit for bit.
- *Any other outer step* (a lossy codec such as configs/pipeline-gpu.toml's int8, whose error is
  small on a pseudo-gradient and not on the weights; momentum; another lr): the anchor (1 W) and,
  with momentum, the momentum (1 W) between rounds, published as they are (no copies: a round
  changes them in place under the worker's lock, and a mate reading them meanwhile gets bytes that
  do not hash to the state's hash and asks again next round). A part holds its pseudo-gradient,
  the exchange's flat copy and the result (3 B); the weights' snapshot is not kept (it is the
  anchor minus the pseudo-gradient).

A round that fails (a stage-mate died, the view changed) changes nothing from the part that
failed on, and the next one makes it up (the next multiple or a still ledger's round; a period
later on the clock). The parts before it stay done: with plain
averaging they are averaged weights like any; with an anchor, the published outer state says so
(``parts``: [round, parts done]), and `newest` ranks a state with more parts of a later round above
one at the same round without them, so mates a part apart re-converge as mates a round apart do.

A peer alone in its stage holds no sync state at all (no anchor, no momentum, nothing
published): it skips rounds, and its first round with a mate takes its weights as the anchor. The
anchor, the outer momentum and the round the anchor is at (the last one completed here or adopted)
are published as ``stage/<s>/outer`` after every change, so a peer that joins the stage loads them
with the weights and its next round agrees with the others'.

**Mates a round apart re-converge.** A round can complete on one mate and fail on another: the
other lost its reduced chunk and could not fetch the published result before its deadline (a cut
network, a late loop), or it loaded the outer state just before a round it took no part in. The
outer momentum moves the weights even in rounds without traffic, so two anchors one round apart
never agreed again. So every round with mates starts by asking each mate where its outer state is
(a ``GetState`` of the round number alone: the manifest gives the state's hash). If a mate is at a
later round than this peer, or at the same round with another state, the peer fetches the newest
(hash-verified) and adopts its anchor and momentum; its weights move as a completed round moves
them: the new anchor plus what was trained since the snapshot of the round that failed here, if
that is the round adopted, else since the old anchor. The rule is the same on every mate, so they
agree within one round: the latest round wins, a tie between different states goes to the smallest
hash, and a mate at an older round is never adopted (it cannot pull the others back). Two mates
that both failed a round are both still at the round before, with one state: nothing to adopt. A
state that has this round in it already (the others completed it without this peer) makes the peer
skip the round. A mate that does not answer within ``probe_s`` (a quarter period) is looked at
again next round; ``tests/test_pipeline_sync.py`` cuts one mate's round short and checks that one
round later both hold one state, bit for bit.

Stopping (``drain``): no new round starts, a round in flight finishes, and the peer server stays up
for one round deadline after it, so a stage-mate whose copy of that round did not complete can
still catch up from this peer's published result (node/exchange/catchup.py). Cancelling a round
halfway instead left one mate a round ahead of the other: the outer momentum moves the weights even
in an idle round, so the two never agreed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch

from murmur.node.exchange.grpc_exchange import GrpcExchange
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import RunningLoop
from murmur.node.net.server import PeerServer, PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch, get_parts, result_name
from murmur.node.pipeline.memory import collect_cycles
from murmur.node.pipeline.sync_buckets import Piece, cut, elements_of, is_part_of, part_key, views
from murmur.node.pipeline.worker import StageWorker
from murmur.optim.exchange import ExchangeError
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.protocol.identity import BannedError
from murmur.protocol.reachability import dialable
from murmur.protocol.runconfig import SyncSection
from murmur.protocol.wire import WireError, WireLimits, bytes_to_tensor, tensors_hash

log = logging.getLogger(__name__)

ANCHOR, MOMENTUM, ROUND = "anchor/", "momentum/", "round"
# [r, k]: the first k parts of round r (in its order) completed here, the round then failing
PARTS = "parts"


# How often a peer syncing by samples looks at the ledger total it last heard (a number in memory,
# no call): a round starts at most this long after the peer heard its multiple passed.
LEDGER_POLL_S = 0.1


def outer_name(stage: int) -> str:
    return f"stage/{stage}/outer"


def due_round(total: int, every: int, started: int, still_s: float, every_s: float) -> int | None:
    """The id of the round to start now when rounds count in the run's samples, or None.

    ``total``: the ledger's samples as heard now; ``every``: pipeline.sync_every_samples;
    ``started``: the id of the last round this peer started (or the multiple the ledger was past
    when it became the stage); ``still_s``: how long the total has not moved. The next multiple
    after ``started`` once the ledger passed it (several passed: each in turn, so that every mate
    walks the same ids); else the total itself once it has stood still for ``every_s`` with
    samples past ``started``."""
    after = (started // every + 1) * every
    if total >= after:
        return after
    if total > started and still_s >= every_s:
        return total
    return None


def averages_weights(sync: SyncSection) -> bool:
    """Whether a round can average the mates' weights themselves and hold no state between rounds.

    Outer lr 1 without momentum makes the outer step the mean itself; the fp32 codec without error
    feedback carries weights exactly (int8 or bf16 would lose on the weights what they lose harmlessly
    on a pseudo-gradient); and the plain mean gives the same result on weights as on pseudo-
    gradients (the robust rules' norm filter tells odd pseudo-gradients apart, not weights)."""
    return (sync.outer_lr == 1.0 and sync.outer_momentum == 0.0 and sync.codec == "fp32"
            and sync.error_feedback != "on" and sync.aggregator == "mean")


@dataclass(frozen=True, slots=True)
class OuterAt:
    """Where a peer's published outer state is: the round its anchor is at, and the state's hash;
    ``partial``: (r, k), the first k parts of a later round r that completed there before that
    round failed (the anchor moved by them); (-1, 0) for none."""

    round: int
    state_hash: bytes
    partial: tuple[int, int] = (-1, 0)


def newest(own: OuterAt, mates: dict[str, OuterAt]) -> tuple[OuterAt, list[str]] | None:
    """The outer state this peer should adopt and the mates that publish it, or None to keep its own.

    The latest round wins; a tie between different states at that round goes to the smallest hash,
    so every mate that sees the same states picks the same one. A mate at an older round is never
    adopted: it cannot pull the others back."""
    best = min([own, *mates.values()], key=lambda o: (-o.round, -o.partial[0], -o.partial[1], o.state_hash))
    if best == own:
        return None
    return best, sorted(n for n, o in mates.items() if o == best)


@dataclass(slots=True)
class Missed:
    """A round that failed here after a part's pseudo-gradient was taken: its id, the part that
    failed and its pseudo-gradient (the anchor minus the weights' snapshot: the snapshot is not
    kept), and the samples at the round's start. The parts before it completed here (their anchor
    is the round's); the parts after it took no pseudo-gradient."""

    round: int
    index: int  # which part
    part: list[Piece]
    delta: list[torch.Tensor]
    samples: int


class StageGroup:
    """A round's members: the peers serving the stage now, by the coordinator's view; for a round
    of a fixed group (the last round at a stop, node/pipeline/stop_sync.py), that group."""

    def __init__(self, mates: Callable[[int], Awaitable[dict[str, str]]], stage: Callable[[], int]) -> None:
        self.mates, self.stage = mates, stage
        self.fixed: dict[str, dict[str, str]] = {}  # key -> members

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        if key in self.fixed:
            return dict(sorted(self.fixed[key].items()))
        return dict(sorted((await self.mates(self.stage())).items()))


class StageSync:
    def __init__(
        self,
        server: PeerServer,
        sync: SyncSection,
        every_s: float,
        mates: Callable[[int], Awaitable[dict[str, str]]],
        faults: FaultInjector | None = None,
        *,
        bucket_mb: float = 16.0,
        every_samples: int = 0,
        ledger: Callable[[], int] | None = None,
    ) -> None:
        self.server, self.sync, self.every_s, self.mates = server, sync, every_s, mates
        # Rounds by the run's samples (module docstring): every ``every_samples`` of the ledger's
        # total as ``ledger()`` says it now (samples); without both, rounds on the clock.
        self.every_samples = every_samples if ledger is not None else 0
        self.ledger = ledger
        self._started = 0  # by samples: the id of the last round started (a multiple, or a still total)
        self._heard, self._heard_at = -1, time.monotonic()  # the ledger's total, and when it last moved
        # A round's exchange runs in parts of at most this many elements (node/pipeline/sync_buckets.py):
        # pipeline.sync_bucket_mb; 0, the whole stage at once.
        self.bucket_elements = elements_of(bucket_mb)
        self.plain = averages_weights(sync)  # the round averages the weights: no anchor at all
        self.worker: StageWorker | None = None
        self.anchor: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] | None = None  # only with sync.outer_momentum > 0, made at the first step
        self.samples_base = 0
        self.rounds = 0  # completed
        self.idle_rounds = 0  # of those, rounds in which no mate had trained: no outer step
        self.last_round = -1  # the round the anchor is at: the last one completed here or adopted
        self.adopted = 0  # outer states taken from a mate at a later round (or the tie's winner)
        self._missed: Missed | None = None  # the last round, if it failed here after its snapshot
        self._unsettled = False  # plain averaging: the last round failed here (its mates may have moved)
        self._at = OuterAt(-1, b"")  # where the published outer state is
        self._partial = (-1, 0)  # OuterAt.partial of this peer's anchor
        self.failed = 0
        self.last_error = ""
        self.peak_round_bytes = 0  # the most a round held at once (a part's snapshot or pseudo-gradient, copy, result)
        self.parts = 1  # the parts of the last round with mates
        self._stopping = False
        self._in_round: asyncio.Task[bool] | None = None
        self._completed_at = 0.0  # monotonic time of the last completed round
        self._group = StageGroup(mates, lambda: self.worker.span.index if self.worker is not None else -1)
        # A round ends before the next one starts: stage-mates stay in step.
        self.deadline_s = deadline = 0.75 * every_s
        # How long a round's start waits for a mate to say where its outer state is.
        self.probe_s = 0.25 * every_s
        self.exchange = GrpcExchange(
            server, RunningLoop(asyncio.get_running_loop()), self._group, make_codec_for(sync),
            aggregator=make_aggregator_for(sync),
            settings=ExchangeSettings(peer_timeout=deadline, round_deadline=deadline,
                                      chunk_mb=sync.exchange_chunk_mb),
            faults=faults,  # the peer's ``--fault``s strike its sync rounds too (node/net/faults.py)
        )

    # -- the stage it syncs --------------------------------------------------------------------------

    def reset(self, worker: StageWorker, outer: dict[str, torch.Tensor] | None = None, *, alone: bool = False) -> None:
        """Sync ``worker``'s stage from now on: the anchor and momentum loaded from the stage's
        peers (``outer``: their ``stage/<s>/outer``), else the worker's weights and no momentum;
        ``alone`` (no peer served the stage when this one became it): no sync state until a mate
        comes (`_drop_state`). Plain averaging holds no state whatever comes."""
        self.worker = worker
        self._missed = None
        self._unsettled = False
        if self.every_samples:  # its first round is the next multiple, its mates' next one
            self._started = self.ledger() // self.every_samples * self.every_samples
        loaded = None if self.plain else self._fits(worker, outer)
        if loaded is not None:
            self.anchor, self.momentum, self.last_round = loaded
        elif alone or self.plain:
            self.last_round = -1
            self._drop_state(worker)
            return
        else:
            self.anchor = [p.detach().clone() for p in worker.params]
            self.momentum, self.last_round = None, -1
        self._prepare()
        self.samples_base = worker.stats.samples_total
        self._publish()

    @property
    def holds_state(self) -> bool:
        """Whether this peer holds an anchor (and a published outer state): only while it has mates,
        and never with plain averaging."""
        return bool(self.anchor)

    def _drop_state(self, worker: StageWorker) -> None:
        """Alone in its stage (or not yet in a round with mates): no anchor, no momentum, nothing
        published. A lone peer's anchor would only follow its weights (it has nobody to average
        with), yet it cost three copies of the stage: the anchor, and the anchor and a zero momentum
        published for joiners. A joiner that finds no outer state starts from the weights it fetched,
        which is what the anchor would have told it; the first round with a mate makes the anchor."""
        self.anchor, self.momentum, self._missed, self._partial = [], None, None, (-1, 0)
        self.samples_base = worker.stats.samples_total
        self.server.unpublish_state(outer_name(worker.span.index))
        self._at = OuterAt(self.last_round, b"")

    async def _make_anchor(self, worker: StageWorker) -> None:
        """The first round with a mate: the anchor is the weights now, no momentum yet (a mate's
        state, if it differs, is adopted by `_catch_up` within a round)."""
        samples = worker.stats.samples_total
        self.anchor, self.momentum = await asyncio.to_thread(self._snapshot, worker), None
        self._prepare()
        self.samples_base = samples
        self._publish()

    def _fits(
        self, worker: StageWorker, outer: dict[str, torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int] | None:
        """(anchor, momentum, round) from a published outer state if it fits ``worker``'s stage
        (a state without a round, from a peer before rounds were published, is at round -1; one
        without momentum, from a step without momentum, has none)."""
        if outer is None:
            return None
        named = dict(worker.module.named_stage_parameters())
        anchors, momenta = [ANCHOR + n for n in named], [MOMENTUM + n for n in named]
        names = set(outer) - {ROUND, PARTS}
        if names != set(anchors) and names != set(anchors) | set(momenta):
            return None
        for n, p in named.items():
            if outer[ANCHOR + n].shape != p.shape or (MOMENTUM + n in outer and outer[MOMENTUM + n].shape != p.shape):
                return None
        r = outer.get(ROUND)
        at = int(r.reshape(-1)[0]) if r is not None and r.numel() == 1 else -1
        # Copies: what arrived may be read-only wire memory, and a round changes these in place.
        anchor = [outer[ANCHOR + n].to(p.device, copy=True) for n, p in named.items()]
        momentum = None
        if self.sync.outer_momentum > 0 and MOMENTUM + next(iter(named)) in outer:
            momentum = [outer[MOMENTUM + n].to(p.device, copy=True) for n, p in named.items()]
        return anchor, momentum, at

    def _prepare(self) -> None:
        for a in self.anchor:
            a.requires_grad_(False)
        if self.sync.outer_momentum == 0:
            self.momentum = None  # a momentum of 0 is no state (a mate's zeros published before: dropped)

    def published(self) -> PublishedState | None:
        """The outer state for joiners and for mates a round apart: the anchor and momentum
        themselves, not copies (a round changes them under the worker's lock; a read that spans
        that change fails its hash check and is made again)."""
        if self.worker is None or not self.anchor:
            return None
        names = [n for n, _ in self.worker.module.named_stage_parameters()]
        tensors = [(ANCHOR + n, a) for n, a in zip(names, self.anchor, strict=True)]
        if self.momentum is not None:
            tensors += [(MOMENTUM + n, m) for n, m in zip(names, self.momentum, strict=True)]
        tensors.append((ROUND, torch.tensor([self.last_round], dtype=torch.int64)))
        if self._partial[1]:
            tensors.append((PARTS, torch.tensor(self._partial, dtype=torch.int64)))
        return PublishedState(outer_name(self.worker.span.index), tensors, tensors_hash(tensors))

    def _publish(self) -> None:
        state = self.published()
        if state is not None:
            self.server.publish_state(state)
            self._at = OuterAt(self.last_round, state.state_hash, self._partial)

    # -- when rounds start --------------------------------------------------------------------------

    async def _next_round(self) -> int | None:
        """The id of the next round once it is due (None: stopping, or no stage yet)."""
        if not self.every_samples:  # on the clock
            now = time.time()
            r = int(now // self.every_s) + 1
            await asyncio.sleep(r * self.every_s - now)
            return None if self.worker is None or self._stopping else r
        while not self._stopping:
            total = self.ledger()
            now = time.monotonic()
            if total != self._heard:
                self._heard, self._heard_at = total, now
            r = due_round(total, self.every_samples, self._started, now - self._heard_at, self.every_s)
            if r is not None and self.worker is not None:
                self._started = r
                return r
            await asyncio.sleep(LEDGER_POLL_S)
        return None

    async def run(self, on_round: Callable[[], None] = lambda: None) -> None:
        while not self._stopping:
            r = await self._next_round()
            if r is None:
                continue
            # A task of its own, so that drain() can let it finish while this loop is cancelled.
            self._in_round = asyncio.ensure_future(self.round(r))
            try:
                if await asyncio.shield(self._in_round):
                    on_round()
            except Exception as err:  # noqa: BLE001 - a failed round (or an unreachable coordinator) skips it
                self.failed += 1
                self.last_error = str(err)[:300]
                log.info("stage sync round %d failed: %s", r, err)
            finally:
                if self._in_round.done():
                    # A failed round's task holds its exception, whose traceback holds the round's
                    # tensors (its snapshot, the exchange's copy and result, the chunks received)
                    # in reference cycles: let go of it and collect them now, not at a full
                    # collection that may never come (memory.collect_cycles).
                    self._in_round = None
                    collect_cycles()

    async def drain(self, *, linger: bool = True) -> None:
        """Stop starting rounds; let the one in flight finish (its own deadline bounds it), then
        keep serving its result for one round deadline so that stage-mates can catch up (unless
        ``linger`` is False: a last round at the stop follows, during which the peer server stays up
        at least as long for the mates that do not stop, node/pipeline/stop_sync.py)."""
        self._stopping = True
        in_round = self._in_round  # run() lets go of it once it is done
        if in_round is not None and not in_round.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(in_round), self.deadline_s + 1.0)
            in_round.cancel()  # still running past its deadline: a hung mate; give it up
        del in_round
        wait = self._completed_at + self.deadline_s - time.monotonic()
        if linger and self._completed_at and wait > 0:
            await asyncio.sleep(wait)

    async def round(self, r: int, key: str = "", members: dict[str, str] | None = None) -> bool:
        """One round; False when the peer is alone in its stage (its anchor follows its weights),
        or when the outer state it adopted from a mate already includes this round. ``key`` and
        ``members``: a round of a fixed group under a key of its own (the last round at a stop,
        node/pipeline/stop_sync.py) instead of the stage's round among its peers.

        The exchange runs in parts (node/pipeline/sync_buckets.py), one after the other, each under
        its own key (``<key>/part<i>``) and all among the members this round started with."""
        worker = self.worker
        stage = worker.span.index
        key = key or f"stage/{stage}"
        mates = dict(members) if members is not None else await self.mates(stage)
        if len(mates) < 2:
            if self.anchor or self.server.states.get(outer_name(stage)) is not None:
                self._drop_state(worker)
            else:
                self.samples_base = worker.stats.samples_total
            return False
        parts = cut([p.numel() for p in worker.params], self.bucket_elements)
        keys = [part_key(key, i, len(parts)) for i in range(len(parts))]
        # In an order rotated by the round (the same on every mate): a round cut short by its
        # period (under load) leaves other parts unsynced each time, not always the last ones.
        # By samples the ids are multiples: the rotation counts them.
        first = (-(-r // self.every_samples) if self.every_samples else r) % len(parts)
        parts, keys = parts[first:] + parts[:first], keys[first:] + keys[:first]
        for k in keys:  # every part among the same members: one view of the stage a round
            self._group.fixed[k] = mates
        self.parts = len(parts)
        try:
            if self.plain:
                return await self._average(worker, r, parts, keys)
            if not self.anchor:
                await self._make_anchor(worker)
                if self.worker is not worker:
                    return False
            await self._catch_up(worker, stage, mates, r)
            if self.worker is not worker or self.last_round >= r:
                return False  # moved meanwhile, or a mate's state has this round in it already
            return await self._step_round(worker, r, parts, keys)
        finally:
            for k in keys:
                self._group.fixed.pop(k, None)
            # The exchange's results of this key: older ones go now, this round's once its mates
            # are past its deadline (they catch up from it until then).
            self._drop_results(key, r)
            asyncio.get_running_loop().call_later(self.deadline_s, self._drop_results, key, r + 1)

    def _drop_results(self, key: str, before: int) -> None:
        """Unpublish the exchange's results of ``key`` (and its parts) from rounds before ``before``.

        The exchange serves each round's result (1 W) to the mates catching up and forgets the one
        ``keep_results`` rounds back; with rounds that failed or were skipped in between, the older
        ones stayed, up to the peer server's eight published states: stages of two peers of
        benchmarks/peer_memory.py, their rounds failing under load, peaked at 3.2-4.8 x their
        training state (1.4-1.6 for a peer alone)."""
        for name in list(self.server.states):
            head, _, rest = name.partition("/")
            r, _, k = rest.partition("/")
            if head == "result" and is_part_of(k, key) and r.lstrip("-").isdigit() and int(r) < before:
                self.server.unpublish_state(name)

    def _drop_part_before(self, r: int, keys: list[str], i: int, members: list[str]) -> None:
        """Part ``i`` of round ``r`` completed with ``members``: each of them started it after it had
        part ``i - 1``'s result, so with every member of the round in it nobody can still need that
        result, and it goes now instead of a deadline after the round. Without this the results of
        every part stayed published until then: the whole stage once more (1 W), between rounds."""
        if i and set(members) >= set(self._group.fixed.get(keys[i], {})):
            self.server.unpublish_state(result_name(r, keys[i - 1]))

    def _check_time(self, started: float, r: int, i: int, parts: int) -> None:
        """A round's parts start within a period of its start (each part's exchange is bounded by
        the round deadline). Not within the deadline itself: under load (25-40 on the 2-core build
        machine, 8 peers) a stage's six parts took longer than it and the rounds failed half-way;
        a round that runs long only makes the peer skip the clock's next round (`run`; by samples it
        runs the next multiple late), and a mate
        that is there without it fails that one round. The parts done stay done, and the next
        round starts at another part (`round`), so every part is synced in turn."""
        if i and asyncio.get_running_loop().time() - started > self.every_s:
            raise ExchangeError(f"round {r}: past its period after {i} of {parts} parts")

    async def _step_round(self, worker: StageWorker, r: int, parts: list[list[Piece]], keys: list[str]) -> bool:
        """The exchange of the pseudo-gradients and the outer step, part by part; False if the peer
        moved to another stage meanwhile. A part whose mean is exactly zero (no mate trained since
        the last round) makes no outer step; the round is idle if no part made one."""
        started = asyncio.get_running_loop().time()
        samples0 = worker.stats.samples_total  # the round's weight, whichever part
        weight = 1.0 + samples0 - self.samples_base
        stepped = False
        for i, (part, k) in enumerate(zip(parts, keys, strict=True)):
            try:
                self._check_time(started, r, i, len(parts))
                delta, steps = await asyncio.to_thread(self._pseudo_gradient, worker, part)
            except Exception:
                self._failed_after(r, i)
                raise
            try:
                res = await self.exchange.areduce(delta, round_id=r, key=k, weight=weight)
            except Exception:
                self._missed = Missed(r, i, part, delta, samples0)  # a mate may have completed it: see _catch_up
                self._failed_after(r, i)
                raise
            self.peak_round_bytes = max(self.peak_round_bytes, 3 * _nbytes(delta))  # delta, its flat copy, result
            self._drop_part_before(r, keys, i, res.members)
            if self.worker is not worker:  # moved to another stage meanwhile
                return False
            # No mate trained since the last round: no outer step, so the momentum does not move
            # the weights of a stage nobody trains (it did: a val loss of 2.62 became 3.94 in 30 s
            # of idle rounds). Every mate got the same result, so they all skip alike and stay
            # in one state at this round.
            if any(bool(d.any()) for d in res.tensors):
                await asyncio.to_thread(self._outer_step, worker, part, delta, res.tensors, steps)
                stepped = True
            del delta, res
        self._settled(samples0, r, idle=not stepped)
        self._publish()
        return True

    def _failed_after(self, r: int, done: int) -> None:
        """Round ``r`` failed here after its first ``done`` parts completed: the anchor moved by
        them, so the published state says so (a mate at the same round without them adopts it, and
        this peer adopts a mate's that has more of the round: `newest`)."""
        if done:
            self._partial = (r, done)
            self._publish()

    async def _average(self, worker: StageWorker, r: int, parts: list[list[Piece]], keys: list[str]) -> bool:
        """Plain averaging: the weights' snapshots go through the exchange, part by part; the weights
        become the mean plus what was trained during the round. The last number of every part is
        what each mate trained since its last completed round (and 1 after a round that failed
        here), the same in every part: its mean is 0 only if nobody trained, and then nothing
        changes (every mate sees it in the first part and stops there alike)."""
        started = asyncio.get_running_loop().time()
        samples0 = worker.stats.samples_total
        pending = torch.tensor([float(samples0 - self.samples_base + self._unsettled)])
        weight = 1.0 + samples0 - self.samples_base
        for i, (part, k) in enumerate(zip(parts, keys, strict=True)):
            try:
                self._check_time(started, r, i, len(parts))
                snap = await asyncio.to_thread(self._snapshot, worker, part)
                res = await self.exchange.areduce([*snap, pending], round_id=r, key=k, weight=weight)
            except Exception:
                self._unsettled = True
                raise
            self.peak_round_bytes = max(self.peak_round_bytes, 3 * _nbytes(snap))  # snapshot, its flat copy, result
            self._drop_part_before(r, keys, i, res.members)
            if self.worker is not worker:
                return False
            *mean, trained = res.tensors
            if float(trained.reshape(-1)[0]) == 0:  # nobody trained: every mate skips alike
                self._settled(samples0, r, idle=True)
                return True
            await asyncio.to_thread(self._rebase, worker, part, mean, snap)
            del snap, mean, res
        self._settled(samples0, r, idle=False)
        return True

    def _settled(self, samples: int, r: int, *, idle: bool) -> None:
        self.samples_base = samples
        self.idle_rounds += idle
        self.rounds += not idle
        self._missed, self._unsettled = None, False
        self._completed_at, self.last_round = time.monotonic(), r
        self._partial = (-1, 0)

    # -- mates that are a round apart ---------------------------------------------------------------

    async def _catch_up(self, worker: StageWorker, stage: int, mates: dict[str, str], r: int) -> None:
        """Before a round: if a mate's published outer state is at a later round than this peer's
        (its round failed here and completed there, or this peer loaded the state just before a
        round), or at the same round but another state (the smallest hash wins), adopt it. Without
        this the two never agreed again: the outer momentum moves the weights even in idle rounds.
        A state said to be past round ``r`` (the one starting now) is not believed."""
        others = {n: a for n, a in dialable(mates).items() if n != self.server.node_id}
        wheres = await asyncio.gather(*[self._where(n, a, stage) for n, a in others.items()])
        pick = newest(self._at, {n: w for n, w in zip(others, wheres, strict=True) if w is not None and w.round <= r})
        if pick is None:
            return
        at, sources = pick
        try:
            outer, _ = await afetch(
                self.server.identity, {n: others[n] for n in sources}, outer_name(stage), at.state_hash,
                settings=StateFetchSettings(call_timeout=self.deadline_s), ban_list=self.server.ban_list,
            )
        except StateError as err:  # moved on meanwhile, or gone: looked at again next round
            log.info("stage %d: could not adopt the outer state of round %d from %s: %s", stage, at.round, sources, err)
            return
        loaded = self._fits(worker, outer)
        partial = _partial_of(outer.get(PARTS))
        del outer
        if loaded is None or loaded[2] != at.round or partial != at.partial or self.worker is not worker:
            return  # it does not fit this stage, or said another round than its state holds
        anchor, momentum, round_id = loaded
        # The weights move as a completed round moves them: the new anchor plus what was trained
        # since the snapshot of the round that failed here, if that is the round adopted (this
        # peer's input was in it, or the round could not have completed with it missing from a
        # pair); else since the old anchor, so this peer's unsynced training goes into its next round.
        # A state with the first parts of a later round (that round failed there after them) has
        # this peer's failed part in it if it is among those parts.
        missed = self._missed
        in_partial = missed is not None and missed.round == partial[0] and missed.index < partial[1]
        if missed is not None and missed.round != round_id and not in_partial:
            missed = None
        await asyncio.to_thread(self._adopt, worker, anchor, missed)
        self.momentum = momentum
        self._prepare()
        if missed is not None:
            self.samples_base = missed.samples
        self._missed = None
        log.info("stage %d: adopted the outer state of round %d from %s (this peer was at round %d)",
                 stage, round_id, sources, self.last_round)
        self.last_round, self._partial = round_id, partial
        self.adopted += 1
        self._publish()

    async def _where(self, node_id: str, address: str, stage: int) -> OuterAt | None:
        """Where a mate's outer state is: its round (the one tensor asked for) and hash (in the
        manifest), or None if it does not say within ``probe_s``."""
        try:
            manifest, parts = await get_parts(
                self.server.identity, node_id, address, outer_name(stage), [ROUND, PARTS],
                StateFetchSettings(call_timeout=self.probe_s, max_state_bytes=64),  # three numbers, not a flood
                self.server.ban_list,
            )
        except (grpc.RpcError, StateError, BannedError, OSError) as err:
            log.debug("stage %d: %s did not say where its outer state is: %s", stage, node_id, err)
            return None
        info = next((t for t in manifest.tensors if t.name == ROUND), None)
        if info is None:
            return OuterAt(-1, manifest.state_hash)
        pinfo = next((t for t in manifest.tensors if t.name == PARTS), None)
        try:
            r = bytes_to_tensor(parts.get(ROUND, b""), info.dtype, list(info.shape), WireLimits(max_numel=1), ROUND)
            partial = None if pinfo is None else bytes_to_tensor(
                parts.get(PARTS, b""), pinfo.dtype, list(pinfo.shape), WireLimits(max_numel=2), PARTS)
        except WireError:
            return None
        if r.numel() != 1 or (partial is not None and partial.numel() != 2):
            return None
        return OuterAt(int(r.reshape(-1)[0]), manifest.state_hash, _partial_of(partial))

    # -- what changes the weights (in a thread, under the worker's lock) ----------------------------

    def _outer_step(self, worker: StageWorker, part: list[Piece], delta: list[torch.Tensor],
                    mean: list[torch.Tensor], steps: int) -> None:
        """The outer step on the anchor's ``part`` with the mates' mean pseudo-gradient (SGD: ``buf =
        m buf + d``, Nesterov ``d + m buf``, ``anchor -= lr step``), one piece at a time, and the
        weights rebased on it: the new anchor plus what was trained since the snapshot (the snapshot
        is the old anchor minus this peer's pseudo-gradient). In place, under the worker's lock, so a
        checkpoint (which writes the published anchor) never sees half of a part."""
        lr, m, nesterov = self.sync.outer_lr, self.sync.outer_momentum, self.sync.nesterov
        if m > 0 and self.momentum is None:
            self.momentum = [torch.zeros_like(a) for a in self.anchor]
        with worker.lock, torch.no_grad():
            if worker.before_step is not None:
                worker.before_step()
            unchanged = worker.stats.optimizer_steps == steps  # nothing trained since the part's pseudo-gradient
            momenta = views(self.momentum, part) if m > 0 else [None] * len(part)
            for p, a, buf, own, d in zip(views(worker.params, part), views(self.anchor, part), momenta, delta, mean,
                                         strict=True):
                d = d.to(a.device, a.dtype)
                if buf is not None:
                    buf.mul_(m).add_(d)
                    d = d.add(buf, alpha=m) if nesterov else buf
                if unchanged:
                    a.sub_(d, alpha=lr)
                    p.copy_(a)  # bit for bit the anchor: mates that trained nothing meanwhile agree
                else:
                    base = a - own  # the snapshot, within rounding
                    a.sub_(d, alpha=lr)
                    p.sub_(base).add_(a)  # a + (p - base), without two more copies of the piece
            if worker.on_step is not None:
                worker.on_step()

    def _adopt(self, worker: StageWorker, anchor: list[torch.Tensor], missed: Missed | None) -> None:
        """Take a mate's anchor: weights = the new anchor + what was trained since the failed
        round's snapshot (for the part that failed here: the old anchor minus its pseudo-gradient),
        or since the old anchor (every other part: those that completed here hold the round's
        anchor already, those after the failed one took no snapshot)."""
        with worker.lock, torch.no_grad():
            if worker.before_step is not None:
                worker.before_step()
            for p, old in zip(worker.params, self.anchor, strict=True):
                p.sub_(old)
            if missed is not None:
                for p, d in zip(views(worker.params, missed.part), missed.delta, strict=True):
                    p.add_(d)
            for p, new in zip(worker.params, anchor, strict=True):
                p.add_(new)
            self.anchor = anchor  # the old one goes (the published state is replaced right after)
            if worker.on_step is not None:
                worker.on_step()

    @staticmethod
    def _rebase(worker: StageWorker, part: list[Piece], anchor: list[torch.Tensor], base: list[torch.Tensor]) -> None:
        """Weights of ``part`` = ``anchor`` + what was trained since ``base`` (the part's snapshot)."""
        with worker.lock, torch.no_grad():
            if worker.before_step is not None:
                worker.before_step()
            for p, a, b in zip(views(worker.params, part), anchor, base, strict=True):
                p.sub_(b).add_(a.to(p.device))  # a + (p - b), without two more copies of the piece
            if worker.on_step is not None:
                worker.on_step()

    @staticmethod
    def _snapshot(worker: StageWorker, part: list[Piece] | None = None) -> list[torch.Tensor]:
        """A copy of the weights (of ``part``; of the whole stage without one)."""
        with worker.lock:
            if part is None:
                return [p.detach().clone() for p in worker.params]
            return [v.clone() for v in views(worker.params, part)]

    def _pseudo_gradient(self, worker: StageWorker, part: list[Piece]) -> tuple[list[torch.Tensor], int]:
        """``anchor - weights`` of ``part`` now, with the optimizer steps by then: the part's only copy."""
        with worker.lock, torch.no_grad():
            return ([a - p for a, p in zip(views(self.anchor, part), views(worker.params, part), strict=True)],
                    worker.stats.optimizer_steps)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.exchange.aclose()


def _partial_of(t: torch.Tensor | None) -> tuple[int, int]:
    """OuterAt.partial from a published ``parts`` tensor (none: no parts of a later round)."""
    if t is None or t.numel() != 2:
        return (-1, 0)
    r, k = (int(x) for x in t.reshape(-1).tolist())
    return (r, k) if k > 0 else (-1, 0)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
