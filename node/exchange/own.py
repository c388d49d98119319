"""This peer as an owner: the attempt it registers for each try of a call, fed with its own input.

For a reduce, the attempt owns one span of the flat update (node/exchange/attempt.py reduces it
chunk by chunk); this peer's own input to that span is encoded and decoded like every member's,
so every member holds bit-identical results, and it runs at most OWN_LEAD_CHUNKS ahead of the
slowest member (each chunk waiting for the others is held decoded, in fp32). For a gather, the
attempt starts with this peer's own payload in.
"""

from __future__ import annotations

import asyncio

import torch

from murmur.node.exchange.attempt import Attempt, GatherAttempt, ReduceAttempt, RejectionSink, chunk_reducer
from murmur.node.exchange.calls import Call, GatherCall, ReduceCall
from murmur.node.exchange.stats import PhaseTimes, Timeline
from murmur.node.exchange.validate import validate_gather
from murmur.node.net.faults import CallFaults
from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.protocol.wire import WireLimits

OWN_LEAD_CHUNKS = 4  # how far our own input to our span may run ahead of the slowest member


class OwnAttempts:
    def __init__(
        self,
        *,
        peer_id: str,
        aggregator: Aggregator,
        limits: WireLimits,
        times: PhaseTimes,
        timeline: Timeline,
        on_rejected: RejectionSink,
    ) -> None:
        self.peer_id, self.aggregator, self.limits = peer_id, aggregator, limits
        self.times, self.timeline, self.on_rejected = times, timeline, on_rejected

    def make(self, call: Call, number: int, members: tuple[str, ...]) -> Attempt:
        """The attempt ``number`` of ``call`` among ``members``, with this peer's own input in (or
        on its way in, for a reduce: call it on the loop)."""
        owners = call.owners(members)
        if isinstance(call, ReduceCall):
            return self._reduce(call, number, members, owners)
        assert isinstance(call, GatherCall)
        gather = GatherAttempt(
            **_common(call, number, members, owners, self.on_rejected),
            validate=validate_gather(call.expected, call.codec, self.limits, ragged=call.template is not None),
        )
        gather.started.add(self.peer_id)
        gather.add(self.peer_id, call.wires, call.weight)
        if self.peer_id not in gather.owners:
            gather.done.set()  # a client-mode peer takes no inputs: it fetches the result from an owner
        return gather

    def _reduce(
        self, call: ReduceCall, number: int, members: tuple[str, ...], owners: tuple[str, ...]
    ) -> ReduceAttempt:
        if self.peer_id in owners:
            start, end = call.span_of(owners, self.peer_id)
            ranges = call.ranges((start, end))
        else:  # a client-mode peer owns no span: its attempt has no chunk and is done at once
            start, end, ranges = 0, 0, []
        result, timeline = call.result, self.timeline

        def sink(j: int, value: torch.Tensor) -> None:
            timeline.mark("red", j=j)
            a, b = ranges[j]
            result[start + a : start + b] = value

        reducer = chunk_reducer(call.codec, self.aggregator, call.key)
        att = ReduceAttempt(
            **_common(call, number, members, owners, self.on_rejected),
            span=(start, end),
            chunks=ranges,
            reduce_chunk=self.times.wrap("reduce", reducer),
            sink=sink,
            owned=call.owned,
        )
        att.started.add(self.peer_id)
        att.weights[self.peer_id] = call.weight
        att.start()
        att.tasks.append(asyncio.get_running_loop().create_task(self._feed(call, att)))
        return att

    async def _feed(self, call: ReduceCall, att: ReduceAttempt) -> None:
        """Our own input to the span we own, chunk by chunk."""
        start = att.span[0]
        round_trip = self.times.wrap("own", own_round_trip)
        for j, (a, b) in enumerate(att.chunks):
            if not await self._keep_pace(att, j):
                return
            lo, hi = start + a, start + b
            await call.snapshot.ready(lo, hi)
            given, own = await asyncio.to_thread(round_trip, call.codec, call.x[lo:hi], call.key, call.faults, lo)
            if call.own is not None:
                call.own[lo:hi] = own
            att.add_chunk(self.peer_id, j, given)

    async def _keep_pace(self, att: ReduceAttempt, j: int) -> bool:
        """Wait until chunk ``j`` is at most OWN_LEAD_CHUNKS ahead of every other member's input;
        False if the attempt ended meanwhile."""
        others = [m for m in att.members if m != self.peer_id]
        while others and j - min(att.received.get(m, 0) for m in others) > OWN_LEAD_CHUNKS:
            ev = att.changed
            if att.done.is_set():
                return False
            await ev.wait()
        return True


def _common(
    call: Call, number: int, members: tuple[str, ...], owners: tuple[str, ...], on_rejected: RejectionSink
) -> dict:
    """The fields every attempt of ``call`` has."""
    return dict(
        on_rejected=on_rejected,
        op=call.op,
        round_id=call.round_id,
        key=call.key,
        number=number,
        members=members,
        owners=owners,
        layout=call.layout,
    )


def own_round_trip(
    codec: Codec, piece: torch.Tensor, key: str, faults: CallFaults, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(what our input to our own span decodes to, what our error feedback takes it to be): the
    same unless a poisoning fault strikes (it hits the input, not this peer's own state)."""
    given = faults.input_piece(piece, offset, first=False)
    decoded = codec.decode(codec.encode_stateless(given, f"{key}/span"))
    return decoded, decoded if given is piece else piece
