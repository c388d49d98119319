"""One attempt of one call, as its owner sees it: whose input is in, who failed, the result.

For every attempt of every call (round, key) this peer takes part in, an attempt collects the
members' inputs: for a reduce, the span of the flat update this peer owns, chunk by chunk; for a
gather, each member's whole payload. The handlers of node/exchange/collect.py feed it checked
inputs; the caller side (node/exchange/grpc_exchange.py) feeds it this peer's own input.

A reduce attempt is a pipeline: as soon as every member's chunk j is in, chunk j is aggregated in
sorted member order (the run's rule), re-encoded once and decoded (in a worker thread, off the
event loop), and its bytes are ready for the handlers to stream back while later chunks still
arrive. Every member (the owner included) decodes the same bytes, so all hold bit-identical
results. A member that fails (refused, stalled, gone) ends the attempt at once: callers hear ABORT
and retry without it, and whatever chunks were already streamed back are thrown away by them.
A gather attempt finishes when every member is in or failed. Members that never started sending
within ``peer_timeout`` are failed. Only an attempt with every member's whole input produces a
result: no result is ever a partial average.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from murmur.node.exchange.tasks import discard
from murmur.node.exchange.validate import InputRejected
from murmur.optim.aggregate import Aggregator, AggregatorError
from murmur.optim.codecs import Codec
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2
from murmur.protocol.wire import wire_to_proto


@dataclass(frozen=True, slots=True)
class Rejection:
    """An input this owner refused for what it holds, not for arriving late or not at all."""

    round: int
    sender: str
    reason: str


RejectionSink = Callable[[int, str, str], None]  # (round, sender, reason)


def _no_sink(round_id: int, sender: str, reason: str) -> None:
    return None


# (inputs in sorted member order, their weights) -> (decoded result, its payload, index -> why dropped)
ChunkReducer = Callable[[list[torch.Tensor], list[float]], tuple[torch.Tensor | None, bytes, dict[int, str]]]


@dataclass(kw_only=True, slots=True)
class Attempt:
    op: int
    round_id: int
    key: str
    number: int
    members: tuple[str, ...]
    layout: bytes
    # The members that own a span (or, for a gather, take inputs): all but the client-mode ones,
    # which nobody can dial (protocol/reachability.py). A client-mode peer's own attempt owns nothing.
    owners: tuple[str, ...] = ()
    span: tuple[int, int] = (0, 0)  # reduce: the span this peer owns; gather: (0, 0)
    weights: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_received: int = 0  # inputs read from other members
    # Peers that callers named and this attempt lacks (the caller itself, or members its header
    # lists): the next attempt looks at the rendezvous again for them. An owner that calls no one
    # (its only other members are in client mode) learns of them only here.
    heard: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on every change
    # Where this owner records who sent an input it refused for its content (not finite, malformed,
    # an outlier the aggregator's pre-filter dropped): the exchange's `rejections`.
    on_rejected: RejectionSink = _no_sink

    def poke(self) -> None:
        """Wake whoever waits for a change (capture ``changed`` before checking, then wait on it)."""
        ev, self.changed = self.changed, asyncio.Event()
        ev.set()

    def complete(self, member: str) -> bool:
        """Whether ``member``'s whole input is in."""
        raise NotImplementedError

    def reject(self, member: str, reason: str) -> None:
        if self.done.is_set() or member not in self.members or self.complete(member):
            return
        self.failed.setdefault(member, reason)
        self._changed()

    def refuse_input(self, member: str, reason: str) -> None:
        """``member``'s input itself is refused: it leaves the attempt as with ``reject``, and the
        owner records who sent it (once per attempt)."""
        if not self.done.is_set() and member in self.members and member not in self.failed:
            self.on_rejected(self.round_id, member, reason)
        self.reject(member, reason)

    def disagree(self, reason: str) -> None:
        """Members hold different member lists: end the attempt now; callers merge the lists and retry."""
        if not self.done.is_set():
            self.failed["*"] = reason
            self._end()

    def expire(self, timeout: float) -> None:
        """Members that never started sending by now are failed (those mid-stream keep going)."""
        for m in self.members:
            if not self.complete(m) and m not in self.failed and m not in self.started:
                self.failed[m] = f"sent no input within {timeout:g}s"
        self._changed()

    def close(self) -> None:
        """The caller side is done with this attempt: stop its own work (the handlers may still
        be streaming a completed result to other members)."""
        if not self.done.is_set():
            self.failed["*"] = "the owner left this attempt"
            self._end()

    def _end(self) -> None:
        self.done.set()
        self.poke()

    def _changed(self) -> None:
        self.poke()


@dataclass(kw_only=True, slots=True)
class GatherAttempt(Attempt):
    validate: Callable[[str, peer_pb2.Payload], list[WireTensor]]  # -> the checked input, or raises
    inputs: dict[str, list[WireTensor]] = field(default_factory=dict)

    def complete(self, member: str) -> bool:
        return member in self.inputs

    def add(self, member: str, value: list[WireTensor], weight: float) -> None:
        if member in self.failed or self.done.is_set():
            return
        self.inputs[member] = value
        self.weights[member] = weight
        self._changed()

    def _changed(self) -> None:
        if not self.done.is_set() and len(self.inputs) + len(self.failed) >= len(self.members):
            self.done.set()
        self.poke()


@dataclass(kw_only=True, slots=True)
class ReduceAttempt(Attempt):
    chunks: list[tuple[int, int]]  # [a, b) of each chunk, relative to the span's start
    reduce_chunk: ChunkReducer  # runs in a worker thread
    sink: Callable[[int, torch.Tensor], None]  # (chunk, decoded result): the owner keeps its own copy
    pending: list[dict[str, torch.Tensor]] = field(default_factory=list)  # chunk -> member -> input
    received: dict[str, int] = field(default_factory=dict)  # member -> chunks in
    results: list[bytes] = field(default_factory=list)  # the reduced chunks' payloads, in order
    tasks: list[asyncio.Task] = field(default_factory=list)
    owned: bool = False  # a reduce-scatter: this owner keeps its span, no result goes back

    def __post_init__(self) -> None:
        self.pending = [{} for _ in self.chunks]

    def start(self) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(self._reduce_all()))

    @property
    def result_bytes(self) -> int:
        """What this owner streams back to each member: nothing in a reduce-scatter."""
        return 0 if self.owned else sum(len(p) for p in self.results)

    def complete(self, member: str) -> bool:
        return self.received.get(member, 0) == len(self.chunks)

    def add_chunk(self, member: str, index: int, value: torch.Tensor) -> None:
        if member in self.failed or self.done.is_set() or index != self.received.get(member, 0):
            return
        self.pending[index][member] = value
        self.received[member] = index + 1
        self.poke()

    def close(self) -> None:
        if not self.done.is_set():  # the handlers still waiting on it answer ABORT, not silence
            self.failed["*"] = "the owner left this attempt"
            self._end()
        for t in self.tasks:
            discard(t)  # whatever they failed with, the attempt is over
        self.pending = [{} for _ in self.chunks]  # inputs of an aborted attempt are not needed

    def _changed(self) -> None:
        if self.failed and not self.done.is_set():
            self._end()  # the attempt is doomed: tell every caller now, not after the full transfer
        else:
            self.poke()

    async def _reduce_all(self) -> None:
        try:
            for j in range(len(self.chunks)):
                if not await self._all_in(j) or not await self._reduce(j):
                    return
            self._end()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - an aggregation failure aborts the attempt
            if not self.done.is_set():
                self.failed["*"] = f"aggregation failed: {err}"
                self._end()

    async def _all_in(self, j: int) -> bool:
        """Wait until every member's chunk ``j`` is in; False if the attempt ended first."""
        while True:
            ev = self.changed
            if self.done.is_set():
                return False
            if len(self.pending[j]) == len(self.members):
                return True
            await ev.wait()

    async def _reduce(self, j: int) -> bool:
        """Reduce chunk ``j`` (in a worker thread) and hand it on; False if the attempt ended."""
        inputs, self.pending[j] = self.pending[j], {}
        order = sorted(inputs)
        result, payload, dropped = await asyncio.to_thread(
            self.reduce_chunk, [inputs[m] for m in order], [self.weights[m] for m in order]
        )
        if self.done.is_set():
            return False
        if dropped:  # the aggregator's pre-filter left members out: retry without them
            for i, why in dropped.items():
                self.on_rejected(self.round_id, order[i], why)
                self.failed[order[i]] = why
            self._end()
            return False
        assert result is not None
        self.sink(j, result)
        self.results.append(payload)
        self.poke()
        return True


def chunk_reducer(codec: Codec, aggregator: Aggregator, key: str) -> ChunkReducer:
    """Aggregate one chunk in the given (sorted member) order, re-encode once, decode those bytes."""

    def reduce(inputs: list[torch.Tensor], weights: list[float]):
        if sum(weights) <= 0:
            agg = torch.zeros_like(inputs[0])  # only weight-0 joiners: no movement
        else:
            try:
                out, dropped = aggregator([[t] for t in inputs], weights)
            except AggregatorError as err:
                raise InputRejected(str(err)) from None
            if dropped:
                return None, b"", dropped
            agg = out[0]
        wire = codec.encode_stateless(agg, f"{key}/span")
        payload = peer_pb2.Payload(tensors=[wire_to_proto(wire)]).SerializeToString()
        return codec.decode(wire), payload, {}

    return reduce


@dataclass(slots=True)
class DoneRecord:
    result_hash: bytes
    members: list[str]


class RoundBook:
    """Every attempt this peer has registered, and the calls it completed (for ALREADY_DONE)."""

    def __init__(self, keep_done: int = 64) -> None:
        self.attempts: dict[tuple[int, str], dict[int, Attempt]] = {}
        self.current: dict[tuple[int, str], int] = {}
        self.done: OrderedDict[tuple[int, str], DoneRecord] = OrderedDict()
        # The highest attempt number a caller came with, past this peer's own (see saw_attempt).
        self.ahead: dict[tuple[int, str], int] = {}
        self.keep_done = keep_done
        self._changed = asyncio.Condition()
        self.stalled = asyncio.Event()  # fault injection: hold every reply (a stalled machine)

    async def register(self, att: Attempt) -> None:
        rk = (att.round_id, att.key)
        self.attempts.setdefault(rk, {})[att.number] = att
        self.current[rk] = max(self.current.get(rk, -1), att.number)
        async with self._changed:
            self._changed.notify_all()

    def forget(self, round_id: int, key: str) -> None:
        for att in self.attempts.pop((round_id, key), {}).values():
            att.close()
        self.current.pop((round_id, key), None)
        self.ahead.pop((round_id, key), None)

    def saw_attempt(self, rk: tuple[int, str], number: int, caller: str) -> None:
        """A caller is at attempt ``number`` of ``rk``. Past this peer's current attempt, that one
        cannot complete (the caller never sends for it): end it now, so this peer moves on to
        ``number`` rather than wait ``peer_timeout`` for an input that never comes; the next
        attempt this peer starts is ``number`` at least (the caller may come before this peer
        started the attempt it ends). Without this, two peers one attempt apart each waited out
        the other in every attempt and stepped on together, one apart again, until the round's
        deadline (a poisoning run under load)."""
        current = self.current.get(rk)
        if current is None or number <= current:
            return
        self.ahead[rk] = max(self.ahead.get(rk, -1), number)
        att = self.attempts.get(rk, {}).get(current)
        if att is not None:
            att.disagree(f"{caller} is at attempt {number} already")

    def mark_done(self, round_id: int, key: str, record: DoneRecord) -> None:
        self.done[(round_id, key)] = record
        self.done.move_to_end((round_id, key))
        while len(self.done) > self.keep_done:
            self.done.popitem(last=False)

    async def wait_attempt(self, rk: tuple[int, str], number: int, timeout: float) -> Attempt | None:
        """The attempt ``number`` of ``rk`` (or the newer one this peer moved on to), once registered."""

        def ready() -> bool:
            return rk in self.done or self.current.get(rk, -1) >= number

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout)
        except TimeoutError:
            return None
        if rk in self.done:
            return None
        atts = self.attempts.get(rk, {})
        return atts.get(number) or atts.get(self.current[rk])
