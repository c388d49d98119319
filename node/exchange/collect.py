"""The receiving side of the gRPC exchange: what a peer does with the streams other members open.

One stream per (member, owner) and attempt. The header is checked against the attempt first
(membership, member list, operation, layout, span, weight, declared size); then the payload.

Reduce (a span, pipelined): the member sends its span as chunks, one serialized Payload per frame;
each is checked and decoded as it arrives (node/exchange/validate.py, in a worker thread) and
handed to the attempt (node/exchange/attempt.py), which reduces chunk j once every member's chunk j
is in. Meanwhile this handler streams the reduced chunks back in order, and ends with one status:
OK once every chunk is reduced, ABORT (with member -> reason) as soon as the attempt is doomed,
REFUSED if this member's own input was refused. A caller uses the streamed chunks only after OK.
In a reduce-scatter (the attempt is ``owned``) the owner keeps its reduced span: no chunk goes
back, only the status once every chunk is reduced.

Gather (whole payloads): the member's payload in frames, then the attempt's outcome.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from murmur.node.exchange.attempt import Attempt, GatherAttempt, ReduceAttempt, RoundBook
from murmur.node.exchange.stats import PhaseTimes, Timeline
from murmur.node.exchange.tasks import discard
from murmur.node.exchange.validate import InputRejected, decode_chunk
from murmur.protocol import peer_pb2
from murmur.protocol.version import PROTOCOL_VERSION, VersionMismatch
from murmur.protocol.wire import WireError, WireLimits

log = logging.getLogger(__name__)

OK, ABORT, DONE, REFUSED = (
    peer_pb2.ExchangeStatus.OK,
    peer_pb2.ExchangeStatus.ABORT,
    peer_pb2.ExchangeStatus.ALREADY_DONE,
    peer_pb2.ExchangeStatus.REFUSED,
)


@dataclass(kw_only=True, slots=True)
class ServeSettings:
    peer_timeout: float
    round_deadline: float
    max_payload_bytes: int
    run_id: str
    node_id: str
    times: PhaseTimes
    timeline: Timeline


def status(code: int, **kw: object) -> peer_pb2.ExchangeReply:
    return peer_pb2.ExchangeReply(
        status=peer_pb2.ExchangeStatus(code=code, protocol_version=PROTOCOL_VERSION, **kw)
    )


async def serve_exchange(
    book: RoundBook, settings: ServeSettings, peer_id: str, context, codec_of, limits: WireLimits
) -> None:
    """Run one member's stream: header, payload, then the attempt's outcome (and result).
    ``codec_of()`` is the exchange's codec now (the reduce chunks' decoder)."""
    h = await _read_header(context, settings)
    att, answer = await _admit(book, settings, peer_id, h)
    if att is None or answer is not None:
        await context.write(answer)
        return
    att.started.add(peer_id)
    att.weights[peer_id] = float(h.weight)
    if isinstance(att, ReduceAttempt):
        await _serve_reduce(book, settings, peer_id, context, att, h, codec_of, limits)
    else:
        assert isinstance(att, GatherAttempt)
        await _serve_gather(book, settings, peer_id, context, att, h)


async def _read_header(context, s: ServeSettings) -> peer_pb2.ExchangeHeader:
    """The stream's first frame, its header (or the RPC is aborted)."""
    try:
        first = await asyncio.wait_for(context.read(), s.peer_timeout)
    except TimeoutError:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no header within {s.peer_timeout:g}s")
    if first is grpc.aio.EOF or first.WhichOneof("kind") != "header":
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the first frame of an exchange must be its header"
        )
    return first.header


def _door(h: peer_pb2.ExchangeHeader, peer_id: str, s: ServeSettings) -> str:
    """Why this stream is refused before any attempt is looked at, or ""."""
    if h.protocol_version != PROTOCOL_VERSION:
        return str(VersionMismatch(PROTOCOL_VERSION, h.protocol_version))
    if h.sender != peer_id:
        return f"header names {h.sender} but the TLS certificate is {peer_id}"
    if h.run_id != s.run_id:
        return f"run {h.run_id!r} is not this node's run {s.run_id!r}"
    return ""


async def _admit(
    book: RoundBook, s: ServeSettings, peer_id: str, h: peer_pb2.ExchangeHeader
) -> tuple[Attempt | None, peer_pb2.ExchangeReply | None]:
    """(the attempt this stream feeds, None) or (None or the attempt, the answer that ends it)."""
    refused = _door(h, peer_id, s)
    if refused:
        return None, status(REFUSED, reason=refused)
    rk = (int(h.round), h.key)
    if rk in book.done:
        return None, status(DONE, result_hash=book.done[rk].result_hash)
    book.saw_attempt(rk, int(h.attempt), peer_id)
    att = await book.wait_attempt(rk, int(h.attempt), s.peer_timeout)
    if att is None:
        if rk in book.done:
            return None, status(DONE, result_hash=book.done[rk].result_hash)
        # The owner itself is the one missing: the caller drops it, not its own input.
        why = f"did not start round {rk[0]} {rk[1]!r} within {s.peer_timeout:g}s"
        return None, status(ABORT, reason=why, failed={s.node_id: why})
    return att, _attempt_answer(att, h, peer_id, s)


def _attempt_answer(
    att: Attempt, h: peer_pb2.ExchangeHeader, peer_id: str, s: ServeSettings
) -> peer_pb2.ExchangeReply | None:
    """The answer that ends a stream whose header does not fit the attempt, or None."""
    if att.number != h.attempt:
        why = f"attempt {h.attempt} is over here; now at attempt {att.number}"
        return status(ABORT, reason=why, members=list(att.members), attempt=att.number)
    if peer_id in att.members and tuple(h.members) != att.members:
        why = f"member lists differ ({peer_id} has {len(h.members)}, this peer {len(att.members)})"
        att.heard.update(set(h.members) - set(att.members))
        att.disagree(why)
        return status(ABORT, reason=why, members=list(att.members), attempt=att.number)
    if peer_id not in att.members:
        # Left out of this attempt (it came late, or the owner regrouped without it): not a refusal
        # of its input, so ABORT with this attempt's list and number; it may take part in a later one.
        why = f"{peer_id} is not a member of round {att.round_id} attempt {att.number}"
        att.heard.add(peer_id)
        return status(ABORT, reason=why, failed={peer_id: why}, members=list(att.members), attempt=att.number)
    reason = _header_problem(att, h, peer_id, s)
    if reason:
        att.reject(peer_id, reason)
        return status(REFUSED, reason=reason, members=list(att.members), attempt=att.number)
    reason = _oversized(h, s)
    if reason:
        # Refused for what it holds, as a NaN or corrupt input is: the owner records who sent it
        # (the node logs it and reports it to the coordinator, which counts it), once per attempt.
        att.refuse_input(peer_id, reason)
        return status(REFUSED, reason=reason, members=list(att.members), attempt=att.number)
    return None


def _header_problem(att: Attempt, h: peer_pb2.ExchangeHeader, peer_id: str, s: ServeSettings) -> str:
    if h.op != att.op:
        return "operation differs (reduce vs gather)"
    if h.layout_hash != att.layout:
        return "tensor layout (codec, shapes, dtypes, chunking) differs from this peer's"
    if (h.span_start, h.span_end) != att.span:
        return f"span [{h.span_start}, {h.span_end}) is not the span this peer owns {list(att.span)}"
    if not math.isfinite(h.weight) or h.weight < 0:
        return f"weight {h.weight} is not a finite non-negative number"
    if h.payload_bytes < 0:
        return f"payload of {h.payload_bytes} bytes declared"
    return ""


def _oversized(h: peer_pb2.ExchangeHeader, s: ServeSettings) -> str:
    if h.payload_bytes > s.max_payload_bytes:
        return f"oversized update: {h.payload_bytes} bytes declared, over the limit of {s.max_payload_bytes}"
    return ""


# --- reduce: chunks in, reduced chunks out, at the same time ------------------------------------


async def _serve_reduce(
    book: RoundBook, s: ServeSettings, peer_id: str, context, att: ReduceAttempt, h, codec_of, limits
) -> None:
    reader = asyncio.get_running_loop().create_task(_read_chunks(att, h, peer_id, context, s, codec_of, limits))
    reader.add_done_callback(lambda _: att.poke())
    sent = 0
    try:
        while True:
            ev = att.changed
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                err = reader.exception()
                att.reject(peer_id, str(err) if isinstance(err, InputRejected) else f"its stream failed: {err!r}")
                if not isinstance(err, InputRejected):
                    raise err
                await context.write(status(REFUSED, reason=str(err), attempt=att.number))
                return
            if att.done.is_set() and att.failed:
                await _hold_if_stalled(book, s)
                await context.write(
                    status(ABORT, failed=att.failed, members=list(att.members), attempt=att.number)
                )
                return
            if sent < len(att.results) and not att.owned:
                await _hold_if_stalled(book, s)
                s.timeline.mark("out_w0", j=sent, peer=peer_id)
                await context.write(peer_pb2.ExchangeReply(data=att.results[sent]))
                s.timeline.mark("out_w1", j=sent, peer=peer_id)
                sent += 1
                continue
            if att.done.is_set() and (sent == len(att.chunks) or att.owned):
                await context.write(
                    status(OK, contributors=sorted(att.members), payload_bytes=att.result_bytes)
                )
                return
            await ev.wait()
    except asyncio.CancelledError:  # the caller vanished: if its input was not all in, it is out
        att.reject(peer_id, "connection lost while sending its input")
        raise
    finally:
        # Its failure, if any, is the attempt's already (the reader rejects the member itself);
        # a reader cancelled as its read completes may still fail on the finished RPC.
        discard(reader)


async def _hold_if_stalled(book: RoundBook, s: ServeSettings) -> None:
    if book.stalled.is_set():
        await asyncio.sleep(s.round_deadline * 10)  # injected: a stalled machine never answers


async def _read_chunks(att: ReduceAttempt, h, peer_id: str, context, s: ServeSettings, codec_of, limits) -> None:
    """Read, check and decode the member's chunks in order; raises InputRejected naming the reason."""
    total, decoding = 0, None
    codec, decode = codec_of(), s.times.wrap("decode_input", decode_chunk)
    try:
        for j, (a, b) in enumerate(att.chunks):
            data = await _next_chunk(context, s, j, len(att.chunks))
            s.timeline.mark("rx", j=j, peer=peer_id)
            total += len(data)
            att.bytes_received += len(data)
            if total > h.payload_bytes:
                raise _sent_too_much(att, peer_id, total, h.payload_bytes)
            # Decode chunk j in a worker thread while chunk j+1 is read.
            if decoding is not None:
                att.add_chunk(peer_id, j - 1, await _decoded(att, peer_id, decoding))
            decoding = asyncio.ensure_future(asyncio.to_thread(decode, codec, data, b - a, limits))
        if decoding is not None:
            att.add_chunk(peer_id, len(att.chunks) - 1, await _decoded(att, peer_id, decoding))
            decoding = None
    except (WireError, DecodeError) as err:
        raise InputRejected(str(err)) from None
    except asyncio.CancelledError:
        att.reject(peer_id, "connection lost while sending its input")
        raise
    finally:
        discard(decoding)  # a chunk still decoding (or failed) when the stream ended: not needed


async def _decoded(att: Attempt, peer_id: str, decoding: asyncio.Future) -> object:
    """A chunk's decoded values; a chunk that does not decode or is not finite is refused for what
    it holds, and the owner records who sent it."""
    try:
        return await decoding
    except (InputRejected, WireError, DecodeError) as err:
        att.refuse_input(peer_id, str(err))
        raise InputRejected(str(err)) from None


async def _next_chunk(context, s: ServeSettings, j: int, n: int) -> bytes:
    """Chunk ``j`` of ``n`` of a member's input; raises InputRejected if it does not come."""
    try:
        frame = await asyncio.wait_for(context.read(), s.peer_timeout)
    except TimeoutError:
        raise InputRejected(f"stalled: no data for {s.peer_timeout:g}s") from None
    if frame is grpc.aio.EOF:
        raise InputRejected(f"stream ended after {j} of {n} chunks")
    if frame.WhichOneof("kind") != "data":
        raise InputRejected("a second header in one stream")
    return frame.data


def _sent_too_much(att: Attempt, peer_id: str, sent: int, declared: int) -> InputRejected:
    """An input past its declared size: refused for what it holds, recorded as an oversized one."""
    why = f"oversized update: {sent} bytes sent, more than the {declared} it declared"
    att.refuse_input(peer_id, why)
    return InputRejected(why)


# --- gather: one whole payload, then the outcome -------------------------------------------------


async def _serve_gather(
    book: RoundBook, s: ServeSettings, peer_id: str, context, att: GatherAttempt, h
) -> None:
    try:
        value = await _read_payload(att, h, context, s)
    except InputRejected as err:
        att.reject(peer_id, str(err))
        await context.write(status(REFUSED, reason=str(err), attempt=att.number))
        return
    except BaseException:  # the caller vanished mid-stream (its RPC was cancelled): drop it, re-raise
        att.reject(peer_id, "connection lost while sending its input")
        raise
    att.add(peer_id, value, float(h.weight))
    await att.done.wait()
    await _hold_if_stalled(book, s)
    if att.failed:
        await context.write(status(ABORT, failed=att.failed, members=list(att.members), attempt=att.number))
        return
    await context.write(status(OK, contributors=sorted(att.inputs), payload_bytes=0))


async def _read_payload(att: GatherAttempt, h: peer_pb2.ExchangeHeader, context, s: ServeSettings) -> object:
    buf = bytearray()
    while len(buf) < h.payload_bytes or (h.payload_bytes == 0 and not buf):
        try:
            frame = await asyncio.wait_for(context.read(), s.peer_timeout)
        except TimeoutError:
            raise InputRejected(f"stalled: no data for {s.peer_timeout:g}s") from None
        if frame is grpc.aio.EOF:
            if h.payload_bytes == 0:
                break
            raise InputRejected(f"stream ended after {len(buf)} of {h.payload_bytes} bytes")
        if frame.WhichOneof("kind") != "data":
            raise InputRejected("a second header in one stream")
        buf += frame.data
        if len(buf) > h.payload_bytes:
            raise _sent_too_much(att, h.sender, len(buf), h.payload_bytes)
        if h.payload_bytes == 0:
            break
    att.bytes_received += len(buf)
    try:
        payload = peer_pb2.Payload.FromString(bytes(buf))
        return await asyncio.to_thread(att.validate, h.sender, payload)
    except DecodeError as err:
        why = f"malformed payload (not a murmur.v1.Payload): {err}"
    except (WireError, InputRejected) as err:
        why = str(err)
    att.refuse_input(h.sender, why)  # refused for what it holds: the owner records who sent it
    raise InputRejected(why)
