"""Within-stage sync: the peers of one stage keep its weights together with DiLoCo's outer step,
beside the compute, never in its way.

Stage-mates step at different rates (the router gives the faster one more microbatches), so a
round cannot wait for "the H-th step": rounds are on the clock. Round r of stage s starts at
``r * sync_every_s`` of Unix time on every peer serving s, and runs like this:

1. Between two microbatches (under the worker's lock) the peer takes a snapshot of its weights
   and the samples it trained since the last round.
2. On the event loop, off the compute: the pseudo-gradient ``anchor - snapshot`` goes through the
   run's exchange (node/exchange/: the run's codec and aggregator, weighted by those samples,
   members from the coordinator's view of the stage, key ``stage/<s>``), while the worker keeps
   serving microbatches.
3. The run's outer optimizer (SGD with ``sync.outer_lr``, ``sync.outer_momentum``,
   ``sync.nesterov``) steps the anchor with the mean; the weights become
   ``anchor + (weights now - snapshot)``: what was trained during the round is kept on top.

A round that fails (a stage-mate died, the view changed) changes nothing and the next one comes a
period later; a peer alone in its stage skips rounds and moves its anchor to its weights. The
anchor and the outer momentum are published as ``stage/<s>/outer`` after every round, so a peer
that joins the stage loads them with the weights and its next round agrees with the others'.

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

import torch

from murmur.node.exchange.grpc_exchange import GrpcExchange
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import RunningLoop
from murmur.node.net.server import PeerServer, PublishedState
from murmur.node.pipeline.worker import StageWorker
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.protocol.runconfig import SyncSection
from murmur.protocol.wire import tensors_hash

log = logging.getLogger(__name__)

ANCHOR, MOMENTUM = "anchor/", "momentum/"


def outer_name(stage: int) -> str:
    return f"stage/{stage}/outer"


class StageGroup:
    """A round's members: the peers serving the stage now, by the coordinator's view."""

    def __init__(self, mates: Callable[[int], Awaitable[dict[str, str]]], stage: Callable[[], int]) -> None:
        self.mates, self.stage = mates, stage

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        return dict(sorted((await self.mates(self.stage())).items()))


class StageSync:
    def __init__(
        self,
        server: PeerServer,
        sync: SyncSection,
        every_s: float,
        mates: Callable[[int], Awaitable[dict[str, str]]],
        faults: FaultInjector | None = None,
    ) -> None:
        self.server, self.sync, self.every_s, self.mates = server, sync, every_s, mates
        self.worker: StageWorker | None = None
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.SGD | None = None
        self.samples_base = 0
        self.rounds = 0  # completed
        self.last_round = -1  # the id of the last completed round
        self.failed = 0
        self.last_error = ""
        self._stopping = False
        self._in_round: asyncio.Task[bool] | None = None
        self._completed_at = 0.0  # monotonic time of the last completed round
        self._group = StageGroup(mates, lambda: self.worker.span.index if self.worker is not None else -1)
        # A round ends before the next one starts: stage-mates stay in step.
        self.deadline_s = deadline = 0.75 * every_s
        self.exchange = GrpcExchange(
            server, RunningLoop(asyncio.get_running_loop()), self._group, make_codec_for(sync),
            aggregator=make_aggregator_for(sync),
            settings=ExchangeSettings(peer_timeout=deadline, round_deadline=deadline,
                                      chunk_mb=sync.exchange_chunk_mb),
            faults=faults,  # the peer's ``--fault``s strike its sync rounds too (node/net/faults.py)
        )

    # -- the stage it syncs --------------------------------------------------------------------------

    def reset(self, worker: StageWorker, outer: dict[str, torch.Tensor] | None = None) -> None:
        """Sync ``worker``'s stage from now on: the anchor and momentum loaded from the stage's
        peers (``outer``: their ``stage/<s>/outer``), else the worker's weights and no momentum."""
        self.worker = worker
        names = [n for n, _ in worker.module.named_stage_parameters()]
        if outer is not None and sorted(outer) == sorted([ANCHOR + n for n in names] + [MOMENTUM + n for n in names]):
            self.anchor = [outer[ANCHOR + n].clone() for n in names]
            momentum = [outer[MOMENTUM + n] for n in names]
        else:
            self.anchor = [p.detach().clone() for p in worker.params]
            momentum = None
        self.outer = self._optimizer(momentum)
        self.samples_base = worker.stats.samples_total
        self._publish()

    def _optimizer(self, momentum: list[torch.Tensor] | None) -> torch.optim.SGD:
        m = self.sync.outer_momentum
        for a in self.anchor:
            a.requires_grad_(False)
        opt = torch.optim.SGD(self.anchor, lr=self.sync.outer_lr, momentum=m, nesterov=self.sync.nesterov and m > 0)
        if momentum is not None and m > 0:
            for a, buf in zip(self.anchor, momentum, strict=True):
                opt.state[a]["momentum_buffer"] = buf.clone()
        return opt

    def published(self) -> PublishedState | None:
        if self.worker is None:
            return None
        names = [n for n, _ in self.worker.module.named_stage_parameters()]
        momentum = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchor] if self.outer else []
        tensors = [(ANCHOR + n, a.clone()) for n, a in zip(names, self.anchor, strict=True)]
        tensors += [(MOMENTUM + n, (m if m is not None else torch.zeros_like(a)).clone())
                    for n, a, m in zip(names, self.anchor, momentum, strict=True)]
        return PublishedState(outer_name(self.worker.span.index), tensors, tensors_hash(tensors))

    def _publish(self) -> None:
        state = self.published()
        if state is not None:
            self.server.publish_state(state)

    # -- rounds on the clock ---------------------------------------------------------------------

    async def run(self, on_round: Callable[[], None] = lambda: None) -> None:
        while not self._stopping:
            now = time.time()
            r = int(now // self.every_s) + 1
            await asyncio.sleep(r * self.every_s - now)
            if self.worker is None or self._stopping:
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

    async def drain(self) -> None:
        """Stop starting rounds; let the one in flight finish (its own deadline bounds it), then
        keep serving its result for one round deadline so that stage-mates can catch up."""
        self._stopping = True
        if self._in_round is not None and not self._in_round.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._in_round), self.deadline_s + 1.0)
            self._in_round.cancel()  # still running past its deadline: a hung mate; give it up
        linger = self._completed_at + self.deadline_s - time.monotonic()
        if self._completed_at and linger > 0:
            await asyncio.sleep(linger)

    async def round(self, r: int) -> bool:
        """One round; False when the peer is alone in its stage (its anchor follows its weights)."""
        worker = self.worker
        stage = worker.span.index
        mates = await self.mates(stage)
        snap, samples = await asyncio.to_thread(self._snapshot, worker)
        if len(mates) < 2:
            self.anchor = [t.clone() for t in snap]
            self.outer = self._optimizer(None)
            self.samples_base = samples
            self._publish()
            return False
        delta = [a - t for a, t in zip(self.anchor, snap, strict=True)]
        res = await self.exchange.areduce(delta, round_id=r, key=f"stage/{stage}",
                                          weight=1.0 + samples - self.samples_base)
        if self.worker is not worker:  # moved to another stage meanwhile
            return False
        for a, d in zip(self.anchor, res.tensors, strict=True):
            a.grad = d.to(a.dtype)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        await asyncio.to_thread(self._apply, worker, snap)
        self.samples_base = samples
        self.rounds += 1
        self._completed_at, self.last_round = time.monotonic(), r
        self._publish()
        return True

    @staticmethod
    def _snapshot(worker: StageWorker) -> tuple[list[torch.Tensor], int]:
        with worker.lock:
            return [p.detach().clone() for p in worker.params], worker.stats.samples_total

    def _apply(self, worker: StageWorker, snap: list[torch.Tensor]) -> None:
        with worker.lock, torch.no_grad():
            for p, a, s in zip(worker.params, self.anchor, snap, strict=True):
                p.copy_(a + (p - s))  # the anchor, plus what was trained during the round
            if worker.on_step is not None:
                worker.on_step()  # publish the weights the stage serves now

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.exchange.aclose()
