"""One reduce stream from this peer to one owner: our span's chunks out, its reduced chunks back.

The writer encodes the owner's span of our update chunk by chunk in a worker thread (chunk j+1 is
encoded while chunk j is on the wire) and sends one chunk per frame; at the same time the reader
takes the reduced chunks the owner streams back, decodes each in a worker thread into the call's
result buffer, and ends with the owner's status. What landed in the buffer counts only if that
status is OK and every chunk came: an aborted attempt's chunks are overwritten by the attempt
that completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from murmur.node.exchange.calls import ERROR, AttemptProgress, ReduceCall, Reply, reply_of
from murmur.node.exchange.collect import OK
from murmur.node.exchange.settings import CHUNK_OVERHEAD, ExchangeSettings
from murmur.node.exchange.stats import PhaseTimes, Timeline
from murmur.node.exchange.tasks import discard
from murmur.node.exchange.validate import InputRejected, decode_chunk
from murmur.node.net.faults import CallFaults
from murmur.optim.codecs import Codec
from murmur.optim.exchange import ExchangeError
from murmur.protocol import peer_pb2
from murmur.protocol.wire import WireLimits, wire_to_proto


@dataclass(frozen=True, slots=True)
class StreamEnv:
    """What every stream of this peer uses: the settings, the wire limits, the instruments."""

    settings: ExchangeSettings
    limits: WireLimits
    times: PhaseTimes
    timeline: Timeline

    async def write(self, rpc, frame: peer_pb2.ExchangeFrame) -> None:
        await asyncio.wait_for(rpc.write(frame), self.settings.peer_timeout)

    def stalled(self) -> Reply:
        return Reply(ERROR, reason=f"stalled: a write took more than {self.settings.peer_timeout:g}s")


def declared_bytes(codec: Codec, ranges: list[tuple[int, int]]) -> int:
    """What a reduce header declares before the first chunk is encoded: the codec's size for each
    chunk length (measured on zeros: a dense codec's size depends on the length only) plus
    CHUNK_OVERHEAD of slack per chunk."""
    sizes: dict[int, int] = {}
    for a, b in ranges:
        if b - a not in sizes:
            wire = codec.encode_stateless(torch.zeros(b - a), "")
            sizes[b - a] = peer_pb2.Payload(tensors=[wire_to_proto(wire)]).ByteSize()
    return sum(sizes[b - a] + CHUNK_OVERHEAD for a, b in ranges)


@dataclass(slots=True)
class Leg:
    """The ends of one reduce stream: the call, the owner on the other side, the span it owns (and
    its chunks), and the progress that the attempt's streams share."""

    call: ReduceCall
    owner: str
    span: tuple[int, int]
    progress: AttemptProgress
    ranges: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.ranges = self.call.ranges(self.span)


class ReduceStream:
    """Our span's chunks to one owner while its reduced chunks come back, then its status."""

    def __init__(self, env: StreamEnv, leg: Leg, rpc, on_delivered: Callable[[], None]) -> None:
        self.env, self.rpc, self.on_delivered = env, rpc, on_delivered
        self.call, self.owner, self.span, self.ranges, self.progress = (
            leg.call, leg.owner, leg.span, leg.ranges, leg.progress
        )
        self.reader = ResultReader(env, leg)

    async def run(self) -> Reply:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self.reader.read(self.rpc))
        writer = loop.create_task(self._write_chunks())
        try:
            await asyncio.wait([reader, writer], return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                return reader.result()  # an answer before our input was all out can only be a refusal
            return await self._after_writing(reader, writer)
        finally:
            for t in (reader, writer):
                t.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)

    async def _after_writing(self, reader: asyncio.Task, writer: asyncio.Task) -> Reply:
        err = writer.exception()
        if err is None:
            self.on_delivered()
            return await reader
        if isinstance(err, TimeoutError):
            return self.env.stalled()
        if isinstance(err, ExchangeError):
            raise err
        # The stream ended under the writer: the owner answered and closed it, or the connection
        # dropped. Its status, if it sent one, says which.
        try:
            return await asyncio.wait_for(asyncio.shield(reader), self.env.settings.peer_timeout)
        except TimeoutError:
            raise err from None

    async def _write_chunks(self) -> None:
        call, n = self.call, len(self.ranges)
        await call.faults.delay("send_input", target=self.owner)
        nxt: asyncio.Task | None = self._encode(0)
        try:
            for j in range(n):
                assert nxt is not None
                payload, own = await nxt
                nxt = self._encode(j + 1) if j + 1 < n else None
                a, b = self.ranges[j]
                if own is not None and call.own is not None:
                    call.own[self.span[0] + a : self.span[0] + b] = own
                self.env.timeline.mark("in_w0", j=j, peer=self.owner)
                await self.env.write(self.rpc, peer_pb2.ExchangeFrame(data=payload))
                self.env.timeline.mark("in_w1", j=j, peer=self.owner)
                self.progress.moved()
                call.sent += len(payload)
                call.faults.chunk_sent(j + 1, n)
            await self.rpc.done_writing()
        finally:
            discard(nxt)

    def _encode(self, j: int) -> asyncio.Task:
        return asyncio.ensure_future(self._encode_when_copied(j))

    async def _encode_when_copied(self, j: int) -> tuple[bytes, torch.Tensor | None]:
        a, b = self.ranges[j]
        lo, hi = self.span[0] + a, self.span[0] + b
        call = self.call
        await call.snapshot.ready(lo, hi)  # the update is copied piece by piece (snapshot.py)
        encode = self.env.times.wrap("encode", encode_input)
        return await asyncio.to_thread(
            encode, call.codec, call.x[lo:hi], call.key, call.faults, lo, j == 0, call.own is not None
        )


def encode_input(
    codec: Codec,
    piece: torch.Tensor,
    key: str,
    faults: CallFaults,
    offset: int,
    first: bool,
    want_own: bool,
) -> tuple[bytes, torch.Tensor | None]:
    """One chunk of our input (at ``offset`` of the flat update; ``first`` of its stream) as a
    serialized Payload, and what it decodes to, for error feedback. A poisoned or broken chunk
    keeps the honest piece as its error feedback: the faults hit what is sent, not this peer's
    own state. Runs in a worker thread."""
    sent = faults.input_piece(piece, offset, first)
    wire = codec.encode_stateless(sent, f"{key}/span")
    own = (codec.decode(wire) if sent is piece else piece) if want_own else None
    wire = faults.input_wire(wire, first)
    payload = peer_pb2.Payload(tensors=[wire_to_proto(wire)]).SerializeToString()
    return faults.input_payload(payload, first), own


class ResultReader:
    """The owner's reduced chunks, decoded into the call's result as they come, then its status."""

    def __init__(self, env: StreamEnv, leg: Leg) -> None:
        self.env = env
        self.call, self.owner, self.span, self.ranges, self.progress = (
            leg.call, leg.owner, leg.span, leg.ranges, leg.progress
        )
        self.got = 0  # chunks received
        self.total = 0  # their bytes
        self.lost = False  # injected: this owner's result never reaches us
        self.decoding: asyncio.Task | None = None  # the last chunk received, being decoded

    async def read(self, rpc) -> Reply:
        try:
            while True:
                frame = await rpc.read()
                if frame is grpc.aio.EOF:
                    return Reply(ERROR, reason="closed the stream without a status")
                kind = frame.WhichOneof("kind")
                if kind == "status":
                    return await self._on_status(frame.status)
                if kind != "data":
                    return Reply(ERROR, reason="answered with an unknown frame")
                problem = await self._on_data(frame.data)
                if problem:
                    return Reply(ERROR, reason=problem)
        except InputRejected as err:
            return Reply(ERROR, reason=f"its result was refused: {err}")
        finally:
            discard(self.decoding)

    @property
    def expected(self) -> int:
        """Result chunks this owner sends back: none in a reduce-scatter (it keeps its span)."""
        return 0 if self.call.owned else len(self.ranges)

    async def _on_data(self, data: bytes) -> str:
        """Take one reduced chunk; what is wrong with it, or ""."""
        self.env.timeline.mark("res_rx", j=self.got, peer=self.owner)
        self.progress.moved()
        if self.got >= self.expected:
            return f"sent more than the {self.expected} result chunks of its span"
        self.total += len(data)
        limit = self.env.settings.max_payload_bytes
        if self.total > limit:
            return f"its result of over {limit} bytes is over the limit"
        self.lost = self.call.faults.lose_result() or self.lost
        await self._land()  # chunk got-1 decoded while chunk got was read
        if not self.lost:
            a, b = self.ranges[self.got]
            decode = self.env.times.wrap("decode_result", decode_chunk)
            self.decoding = asyncio.ensure_future(
                asyncio.to_thread(decode, self.call.codec, data, b - a, self.env.limits)
            )
        self.got += 1
        return ""

    async def _land(self) -> None:
        if self.decoding is not None:
            a, b = self.ranges[self.got - 1]
            value = await self.decoding
            self.decoding = None
            self.call.result[self.span[0] + a : self.span[0] + b] = value

    async def _on_status(self, st: peer_pb2.ExchangeStatus) -> Reply:
        self.progress.moved()
        reply = reply_of(st)
        if reply.code != OK:
            return reply
        if self.got != self.expected:
            return Reply(ERROR, reason=f"its result ended after {self.got} of {self.expected} chunks")
        if st.payload_bytes != self.total:
            return Reply(ERROR, reason=f"its result is {self.total} bytes, it declared {st.payload_bytes}")
        await self._land()
        if self.lost:
            return Reply(ERROR, reason="its result was lost (injected fault)")
        self.call.received += self.total
        return Reply(OK, members=list(st.contributors))
