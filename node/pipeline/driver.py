"""Drive microbatches through the stages: one hop at a time, retried on stage-mates, counted once.

A driver holds the data (docs/pipeline.md says why the data-holding node drives). For one
microbatch it sends the tokens to a peer of stage 0, the activations on through stages
1..S-2, the last activations with the targets to a peer of the last stage (which returns the
loss and the gradient of its inputs), then the gradients back through stages S-2..0, each
backward carrying that stage's inputs again so any peer of the stage can recompute. A backward
goes first to the peer that ran the stage's forward (its weights made the activations), and to
a stage-mate when that one fails.

Each hop tries at most ``hop_attempts`` peers of its stage, each with the router's adaptive
deadline; a failed attempt benches the peer. When a hop runs out of peers the microbatch fails
as a whole (`MicrobatchFailed`) and is run again from the start later; its tokens count only
when it completes. `CommitWindow` turns completions, which arrive out of order when several
microbatches are in flight, into the contiguous prefix of microbatches that may be committed.

One driver as a process (the data, the coordinator's lease and ledger): node/pipeline/driver_process.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import torch

from murmur.errors import MurmurError
from murmur.node.pipeline import codec
from murmur.node.pipeline.client import Activation, StageClient, StageEndpoint
from murmur.node.pipeline.router import Router
from murmur.protocol.identity import BannedError
from murmur.protocol.runconfig import PipelineSection
from murmur.protocol.wire import WireError

# Microbatches a driver keeps in flight unless told otherwise. Each stage peer holds a forward
# that belongs to its next optimizer step until this step is taken (node/pipeline/step_gate.py), so
# more in flight costs no quality, only waiting: the figures are in docs/pipeline.md.
DEFAULT_CONCURRENCY = 4
MAX_RETRY_PAUSE_S = 30.0  # the longest pause before a failed microbatch runs again
RETRY_POLL_S = 0.1  # how often a pausing lane looks for a peer that entered a stage


class MicrobatchFailed(MurmurError):
    """A hop found no peer of its stage that answered; nothing of the microbatch is committed."""


@dataclass(slots=True)
class Hop:
    stage: int
    kind: str  # forward | backward
    node_id: str
    seconds: float
    attempts: int


@dataclass(slots=True)
class MicrobatchResult:
    loss: float
    hops: list[Hop] = field(default_factory=list)
    wire_bytes: int = 0

    @property
    def retries(self) -> int:
        return sum(h.attempts - 1 for h in self.hops)


class Driver:
    def __init__(
        self, client: StageClient, router: Router, cfg: PipelineSection, *, dim: int,
        progress: Callable[[], int] | None = None,
    ) -> None:
        self.client, self.router, self.cfg, self.dim = client, router, cfg, dim
        # The newest ledger total this driver heard of, told to every stage with each backward: the
        # lr a stage steps at follows the run's progress without waiting for its own poll.
        self.progress = progress or (lambda: 0)

    async def _hop(
        self, stage: int, kind: str, samples: int, call: Callable[[StageEndpoint, float], Awaitable],
        prefer: StageEndpoint | None = None, evaluation: bool = False,
    ):
        tried: list[str] = []
        errors: list[str] = []
        for attempt in range(1, self.cfg.hop_attempts + 1):
            peer = self._pick(stage, kind, samples, tried, prefer if attempt == 1 else None)
            if peer is None:
                break
            tried.append(peer.node_id)
            # a training forward may wait at the stage's step boundary: its deadline allows for that
            deadline = (self.router.forward_deadline(peer) if kind == "forward" and stage < self.cfg.stages - 1
                        and not evaluation else self.router.deadline(peer, kind))
            t0 = time.monotonic()
            try:
                result = await call(peer, deadline)
            except grpc.aio.AioRpcError as err:
                timed_out = err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                errors.append(f"{peer.node_id}: {err.code().name} {err.details() or ''}".strip())
                # The channel stays open: gRPC reconnects it, and closing it would cancel the other
                # microbatches' calls on it.
                self.router.failed(peer, kind, timed_out=timed_out)
                continue
            except (WireError, BannedError) as err:  # a reply we cannot use: the peer's fault
                errors.append(f"{peer.node_id}: {err}")
                self.router.failed(peer, kind, timed_out=False)
                continue
            seconds = time.monotonic() - t0
            self.router.succeeded(peer, kind, samples, seconds)
            return peer, result, Hop(stage, kind, peer.node_id, seconds, attempt)
        raise MicrobatchFailed(
            f"stage {stage} {kind}: no peer answered after {len(tried)} attempts"
            + (f" ({'; '.join(errors)})" if errors else "")
        )

    def _pick(self, stage: int, kind: str, samples: int, tried: list[str], prefer: StageEndpoint | None):
        if prefer is not None:
            st = self.router.state(prefer)
            if st is not None and st.benched_until <= self.router.clock():
                return prefer
        try:
            return self.router.choose(stage, samples, kind=kind, exclude=tried)
        except LookupError:
            return None

    async def run_microbatch(self, name: str, x: torch.Tensor, y: torch.Tensor) -> MicrobatchResult:
        """Loss of one microbatch after its forward and backward went through every stage.

        The activations and gradients travel on as the stages sent them (checked on arrival,
        `codec.check`, and copied into the next request), never decoded here, and the token ids
        are encoded once for the first stage's forward and backward."""
        s_last = self.cfg.stages - 1
        rows = x.shape[0]
        act_codec = self.cfg.activation_codec
        res = MicrobatchResult(loss=float("nan"))
        inputs: list[Activation] = [codec.encode(x, "tokens")]
        forward_peers: list[StageEndpoint] = []
        for stage in range(s_last):
            async def fwd(peer, timeout, inp=inputs[-1]):
                return await self.client.forward_wire(peer, name, inp, reply_codec=act_codec, timeout=timeout,
                                                      dim=self.dim)
            peer, (out, nbytes), hop = await self._hop(stage, "forward", rows, fwd)
            inputs.append(out)
            forward_peers.append(peer)
            res.hops.append(hop)
            res.wire_bytes += nbytes

        async def last(peer, timeout):
            return await self.client.backward(
                peer, name, inputs[-1], targets=y, reply_codec=act_codec, timeout=timeout, dim=self.dim,
                run_tokens=self.progress(),
            )
        _, answer, hop = await self._hop(s_last, "backward", rows, last)
        res.loss, grad = answer.loss, answer.grad_wire
        res.hops.append(hop)
        res.wire_bytes += answer.wire_bytes
        for stage in range(s_last - 1, -1, -1):
            async def bwd(peer, timeout, inp=inputs[stage], g=grad):
                return await self.client.backward(
                    peer, name, inp, grad_outputs=g, reply_codec=act_codec, timeout=timeout, dim=self.dim,
                    run_tokens=self.progress(),
                )
            _, answer, hop = await self._hop(stage, "backward", rows, bwd, prefer=forward_peers[stage])
            grad = answer.grad_wire
            res.hops.append(hop)
            res.wire_bytes += answer.wire_bytes
        return res

    async def evaluate(self, name: str, x: torch.Tensor, y: torch.Tensor) -> float:
        """The loss of one validation microbatch, forward only: through stages 0..S-2, then the
        last stage scores the targets. No peer accumulates or steps anything."""
        s_last = self.cfg.stages - 1
        rows, act_codec = x.shape[0], self.cfg.activation_codec
        h: Activation = x
        for stage in range(s_last):
            async def fwd(peer, timeout, inp=h):
                return await self.client.forward_wire(peer, name, inp, reply_codec=act_codec, timeout=timeout,
                                                      dim=self.dim, evaluation=True)
            _, (h, _), _ = await self._hop(stage, "forward", rows, fwd, evaluation=True)

        async def score(peer, timeout):
            return await self.client.evaluate(peer, name, h, y, activation_codec=act_codec, timeout=timeout)
        _, (loss, _), _ = await self._hop(s_last, "forward", rows, score)
        return loss


class CommitWindow:
    """Which microbatches may be committed: the contiguous prefix of completed ones.

    ``complete(i)`` marks microbatch i done and returns the new committable range [start, end)
    (empty when a gap remains). A microbatch is never in two ranges, and one that has not
    completed is in none.
    """

    def __init__(self, start: int = 0) -> None:
        self.committed = start  # microbatches [0, committed) are committed
        self._done: set[int] = set()

    def complete(self, index: int) -> tuple[int, int]:
        if index < self.committed or index in self._done:
            raise ValueError(f"microbatch {index} completed twice")
        self._done.add(index)
        start = self.committed
        while self.committed in self._done:
            self._done.remove(self.committed)
            self.committed += 1
        return start, self.committed


async def _pause(router: Router, seconds: float) -> None:
    """Wait ``seconds`` before re-running a failed microbatch, or less: until a peer enters a stage
    (a refilled stage serves again at once, not at the end of a doubled pause)."""
    seen, end = router.arrivals, time.monotonic() + seconds
    while time.monotonic() < end and router.arrivals == seen:
        await asyncio.sleep(min(RETRY_POLL_S, max(0.0, end - time.monotonic())))


async def run_in_order(
    driver: Driver,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    count: int,
    *,
    concurrency: int,
    on_done: Callable[[int, MicrobatchResult], None],
    on_commit: Callable[[int, int], Awaitable[None] | None],
    start: int = 0,
    stop: Callable[[], bool] = lambda: False,
) -> int:
    """Microbatches ``start .. start+count-1`` with up to ``concurrency`` in flight (no new one is
    started once ``stop()`` says so: those in flight complete and are committed); a failed one is
    run again after a pause (``microbatch_retry_s``, doubling up to 30 s, cut short when a peer
    enters a stage). The run stops (raising the last `MicrobatchFailed`) only when a microbatch
    failed ``microbatch_attempts`` times and no microbatch at all completed for ``stage_wait_s``:
    a stage whose peers all died is refilled by the coordinator, and the same microbatches go on
    through it. An exception of ``on_commit`` (the lease lost) stops the lanes and is raised.
    Returns the committed end."""
    cfg = driver.cfg
    window = CommitWindow(start)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(start, start + count):
        queue.put_nowait(i)
    failure: list[BaseException] = []
    progress = [time.monotonic()]  # when a microbatch last completed (or the run started)
    # One commit at a time, in the order the window advanced: two lanes' commits in flight at once
    # could reach the ledger out of order (it refuses a commit that does not start at its end).
    committing = asyncio.Lock()

    async def run_one(i: int) -> MicrobatchResult | None:
        x, y = batches(i)
        attempt = 0
        while not failure:
            attempt += 1
            try:
                return await driver.run_microbatch(f"mb{i}.{attempt}", x, y)
            except MicrobatchFailed as err:
                stalled = time.monotonic() - progress[0]
                if attempt >= cfg.microbatch_attempts and stalled >= cfg.stage_wait_s:
                    failure.append(err)
                    return None
                pause = min(MAX_RETRY_PAUSE_S, cfg.microbatch_retry_s * 2 ** min(attempt - 1, 16))
                if stalled < cfg.stage_wait_s:  # do not sleep far past the end of the wait
                    pause = min(pause, max(cfg.microbatch_retry_s, cfg.stage_wait_s - stalled))
                await _pause(driver.router, pause)
        return None

    async def lane() -> None:
        while not failure and not stop():
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            result = await run_one(i)
            if result is None or failure:
                return
            progress[0] = time.monotonic()
            on_done(i, result)
            lo, hi = window.complete(i)
            if hi > lo:
                async with committing:  # a fair lock: no await between complete() and here
                    if failure:
                        return
                    try:
                        maybe = on_commit(lo, hi)
                        if maybe is not None:
                            await maybe
                    except Exception as err:  # noqa: BLE001 - stops every lane; raised below
                        failure.append(err)
                        return

    await asyncio.gather(*(lane() for _ in range(max(1, concurrency))))
    if failure:
        raise failure[0]
    return window.committed
