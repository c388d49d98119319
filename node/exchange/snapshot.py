"""The snapshot of a reduce's update: one flat fp32 copy, made piece by piece while chunks already go.

Copying a large update (plus its error-feedback residual) into a fresh flat buffer costs the
kernel's first touch of every page and a pass over memory: 0.3 s for 400 MB on an idle core, over
a second with four peers on two cores (benchmarks/exchange.py --trace). Made whole before the
first chunk, that time is a link left idle at the start of every round. So the copy runs in a
worker thread piece by piece (pieces of one pipeline chunk), in order, and a sender that needs a
range (the first chunk of every span, at the start) asks for it: its pieces are copied next, ahead
of the rest. The copy starts when the call starts, as the whole copy did. ``order`` says in which
order the pieces were copied; the ``snapshot_piece`` delay fault (node/net/faults.py) slows it.

An update on a GPU is different: a piece copied with a plain ``copy_`` waits for everything the
training thread has queued on the device by then, so each of a base-preset fragment's ~30 pieces
could wait up to an inner step, and a lone node on the H200 waited for its own exchange in most
rounds (0.08 s a round on average for the tree before this copy, node_gpu.json's
same_call_previous_tree; none after). So every piece's transfer is
queued at once, on a stream of its own that starts where the training stream was when the copy
started, and the worker waits for each piece's event: one wait for the queue, then the transfers
at the link's speed.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

import torch

from murmur.node.net.faults import CallFaults


class Snapshot:
    def __init__(
        self,
        tensors: list[torch.Tensor],
        residual: torch.Tensor | None,
        piece: int,
        faults: CallFaults | None = None,
    ) -> None:
        self.numel = sum(t.numel() for t in tensors)
        # From a GPU, into page-locked memory: a transfer at the link's speed instead of through a
        # staging buffer (torch's host allocator reuses the block in the next round).
        self.flat = torch.empty(self.numel, pin_memory=any(t.is_cuda for t in tensors))
        self.complete = asyncio.Event()
        self._tensors = tensors
        self._views: dict[int, torch.Tensor] = {}  # tensor index -> its flat view (worker thread only)
        self._residual = residual if residual is not None and residual.shape == (self.numel,) else None
        self._piece = max(1, piece)
        self._copied = [False] * math.ceil(self.numel / self._piece)
        self.order: list[int] = []  # the pieces, in the order they were copied
        self._faults = faults
        self._events: list[torch.cuda.Event] | None = None  # per piece, when the update is on a GPU
        self._urgent: deque[int] = deque()
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.flat.is_pinned():
            self._queue_transfers()
        self._task = asyncio.get_running_loop().create_task(self._run())
        if not self._copied:
            self.complete.set()

    async def ready(self, lo: int, hi: int) -> None:
        """Wait until [lo, hi) is copied; its pieces go next if they are not."""
        want = range(lo // self._piece, math.ceil(hi / self._piece)) if hi > lo else range(0)
        missing = [i for i in want if not self._copied[i]]
        self._urgent.extend(missing)
        while any(not self._copied[i] for i in missing):
            if self._task is not None and self._task.done():
                self._task.result()  # the copy failed: raise it here
                raise RuntimeError("the snapshot of the update stopped before it was complete")
            ev = self._changed
            await ev.wait()

    async def wait(self) -> torch.Tensor:
        """The whole flat update, once copied."""
        await self.complete.wait()
        return self.flat

    def cancel(self) -> None:
        if self._task is None:
            return
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled():
            self._task.exception()  # a failed copy already failed whoever asked for a range

    async def _run(self) -> None:
        nxt = 0
        try:
            while True:
                while self._urgent and self._copied[self._urgent[0]]:
                    self._urgent.popleft()
                if self._urgent:
                    i = self._urgent.popleft()
                else:
                    while nxt < len(self._copied) and self._copied[nxt]:
                        nxt += 1
                    if nxt == len(self._copied):
                        break
                    i = nxt
                if self._faults is not None:
                    await self._faults.delay("snapshot_piece")
                await asyncio.to_thread(self._copy, i)
                self._copied[i] = True
                self.order.append(i)
                self._poke()
            self.complete.set()
        finally:
            self._poke()

    def _poke(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def _queue_transfers(self) -> None:
        """Queue every piece's copy off the GPU now, on a side stream after the training stream's
        work so far (which made the update), with an event after each piece."""
        sources = [t for t in self._tensors if t.is_cuda]
        device = sources[0].device
        if any(t.device != device for t in sources):
            return  # on several GPUs (no caller does that): piece by piece, each copy waited for
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        stream = torch.cuda.Stream(device=device)
        stream.wait_event(ready)
        for t in sources:
            t.record_stream(stream)  # its memory is not reused before the copies have read it
        self._events = []
        with torch.cuda.stream(stream):
            for i in range(len(self._copied)):
                self._transfer(i, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)

    def _transfer(self, i: int, *, non_blocking: bool = False) -> None:
        lo, hi = i * self._piece, min((i + 1) * self._piece, self.numel)
        pos = 0
        for k, t in enumerate(self._tensors):
            a, b = max(lo, pos), min(hi, pos + t.numel())
            if a < b:
                view = self._views.get(k)
                if view is None:
                    view = self._views[k] = t.detach().reshape(-1)
                self.flat[a:b].copy_(view[a - pos : b - pos], non_blocking=non_blocking)
            pos += t.numel()
            if pos >= hi:
                break

    def _copy(self, i: int) -> None:
        lo, hi = i * self._piece, min((i + 1) * self._piece, self.numel)
        if self._events is not None:
            self._events[i].synchronize()  # queued in start()
        else:
            self._transfer(i)
        if self._residual is not None:
            self.flat[lo:hi].add_(self._residual[lo:hi])
