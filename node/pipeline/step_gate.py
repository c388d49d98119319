"""The step boundary of a stage peer: a microbatch's forward and backward see the same weights.

A stage other than the last answers a microbatch's Forward now and its Backward later (the driver
brings the inputs back and the peer recomputes the forward). With several microbatches in flight,
a peer that stepped its optimizer between the two recomputed the forward on weights other than
the ones whose activations went downstream: the gradient belonged to no model, and the next
step's microbatches were trained on weights one step stale. At the driver's default two in flight
that cost about 4.5 points of validation loss against one process (issue 47).

So a peer admits a training Forward into its current optimizer step only while the samples it
has accumulated plus those of the forwards still waiting for their backward stay below
``target_samples`` (the step that the worker takes when they are in). A forward past that is the
next step's: it waits here, on the event loop and not in the compute queue (the backwards it
waits for must get through), until the step is taken. That is synchronous pipeline training with
a flush per step (GPipe, or SWARM's accumulation of a global batch with a boundary that waits for
the step's microbatches): each step is the exact gradient of the microbatches admitted to it, as
one process accumulating them would compute it. With one peer a stage the last stage then sees
exactly each step's microbatches before the next step's, so it groups them as the first stage
does.

A forward whose backward never comes (the driver gave the microbatch up, or retried the backward
on a stage-mate) would hold the step forever: it is forgotten once it has waited far longer than
forwards here wait for their backward (twice the smoothed wait plus four deviations, as TCP's
retransmission timer and the driver's hop deadlines; at least ``MIN_EXPIRE_S``), and never later
than ``expire_s`` (the run's ``pipeline.hop_timeout_s``): a stage peer whose stage-1 mate died
stalls for a few microbatch round trips, not for the hop timeout. A backward is never held, and
one whose forward ran elsewhere is accumulated as before. The last stage needs no gate: its
forward and backward are one call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

MIN_EXPIRE_S = 2.0  # scheduler noise: no forward is forgotten sooner
RTT_ALPHA, RTT_BETA = 1 / 8, 1 / 4  # RFC 6298's gains


class StepGate:
    """Used on the event loop only (the service's handlers): no lock, and no await between a check
    and what it decides."""

    def __init__(self, accumulated: Callable[[], int], target: int, *, expire_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.accumulated = accumulated  # samples the worker holds toward its next step
        self.target, self.expire_s, self.clock = target, expire_s, clock
        self._pending: dict[str, tuple[int, float]] = {}  # microbatch -> (rows, admitted at)
        self._changed = asyncio.Event()  # set (and replaced) whenever a forward stops being awaited
        self.held = 0  # forwards that waited for a step (how often the boundary acted)
        self.expired = 0  # forwards forgotten without their backward
        self._srtt: float | None = None  # smoothed seconds from a forward's admission to its backward
        self._rttvar = 0.0

    @property
    def expire_after_s(self) -> float:
        if self._srtt is None:
            return self.expire_s
        return min(self.expire_s, max(MIN_EXPIRE_S, 2 * (self._srtt + 4 * self._rttvar)))

    @property
    def pending_samples(self) -> int:
        return sum(rows for rows, _ in self._pending.values())

    def _open(self) -> bool:
        return self.accumulated() + self.pending_samples < self.target

    def _expire(self) -> float | None:
        """Forget forwards older than ``expire_s``; seconds until the next one expires (None: none)."""
        now, after = self.clock(), self.expire_after_s
        for name, (_, at) in list(self._pending.items()):
            if now - at >= after:
                del self._pending[name]
                self.expired += 1
        return min((at + after - now for _, at in self._pending.values()), default=None)

    async def admit(self, microbatch: str, rows: int) -> None:
        """Return once the forward of ``microbatch`` belongs to the current step (it is then
        counted until `done`). Cancelled while waiting (the caller gave up): nothing counted."""
        waited = False
        while not self._open():
            waited = True
            left = self._expire()
            if self._open():
                break
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout=left)
            except TimeoutError:
                pass
        self.held += waited
        self._pending[microbatch] = (rows, self.clock())

    def done(self, microbatch: str) -> None:
        """The backward of ``microbatch`` was computed here (or it failed, or its caller left): it
        is no longer awaited, and a step it completed lets the held forwards through."""
        admitted = self._pending.pop(microbatch, None)
        if admitted is not None:
            rtt = self.clock() - admitted[1]
            if self._srtt is None:
                self._srtt, self._rttvar = rtt, rtt / 2
            else:
                self._rttvar = (1 - RTT_BETA) * self._rttvar + RTT_BETA * abs(self._srtt - rtt)
                self._srtt = (1 - RTT_ALPHA) * self._srtt + RTT_ALPHA * rtt
        self._changed.set()
        self._changed = asyncio.Event()
