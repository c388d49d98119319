"""The receiving side of the gRPC exchange: what a peer does with the streams other members open.

For every attempt of every call (round, key) this peer takes part in, an ``Attempt`` collects
the members' inputs: for a reduce, the span of the flat update this peer owns; for a gather, each
member's whole payload. Every input is checked before it counts (the header against the attempt:
membership, member list, layout, span, size; then the payload: protobuf, dtypes, shapes, codec,
finite values); a refusal names its reason and marks that member failed for the attempt.

An attempt finishes when every member is in or failed, or ``peer_timeout`` after it started for
members that never showed up. If anyone failed, every caller gets ABORT with the failures and
the round is retried without them (node/exchange_grpc.py); only an attempt with every member's
input produces a result, so no result is ever a partial average. The owner aggregates in
sorted member order and re-encodes once; every member (the owner included) decodes the same
bytes, so all hold bit-identical results.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf.message import DecodeError
from murmur.optim.aggregate import Aggregator, AggregatorError
from murmur.optim.codecs import Codec
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2
from murmur.protocol.version import PROTOCOL_VERSION, VersionMismatch
from murmur.protocol.wire import WireError, WireLimits, check_finite, split, wire_from_proto, wire_to_proto

from murmur.errors import MurmurError

log = logging.getLogger(__name__)

OK, ABORT, DONE, REFUSED = (
    peer_pb2.ExchangeStatus.OK,
    peer_pb2.ExchangeStatus.ABORT,
    peer_pb2.ExchangeStatus.ALREADY_DONE,
    peer_pb2.ExchangeStatus.REFUSED,
)


class InputRejected(MurmurError):
    """One member's input cannot be used in this attempt; the message is the reason."""


@dataclass(slots=True)
class Attempt:
    op: int
    round_id: int
    key: str
    number: int
    members: tuple[str, ...]
    layout: bytes
    span: tuple[int, int]  # reduce: the span this peer owns; gather: (0, 0)
    validate: Callable[[str, peer_pb2.Payload], object]  # -> the decoded input, or raises
    finalize: Callable[[Attempt], None]  # computes the result once every input is in
    inputs: dict[str, object] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: object = None  # reduce: decoded span; gather: None
    result_payload: bytes = b""  # reduce: serialized Payload sent back to callers
    bytes_received: int = 0  # inputs read from other members
    finishing: bool = False  # the result is being computed

    def add(self, member: str, value: object, weight: float) -> None:
        if member in self.failed or self.done.is_set() or self.finishing:
            return
        self.inputs[member] = value
        self.weights[member] = weight
        self._maybe_finish()

    def reject(self, member: str, reason: str) -> None:
        if self.done.is_set() or self.finishing or member not in self.members:
            return
        self.inputs.pop(member, None)
        self.failed.setdefault(member, reason)
        self._maybe_finish()

    def disagree(self, reason: str) -> None:
        """Members hold different member lists: end the attempt now; callers merge the lists and retry."""
        if not self.done.is_set() and not self.finishing:
            self.failed["*"] = reason
            self.done.set()

    def expire(self, timeout: float) -> None:
        """Members that never started sending by now are failed (those mid-stream keep going)."""
        for m in self.members:
            if m not in self.inputs and m not in self.failed and m not in self.started:
                self.failed[m] = f"sent no input within {timeout:g}s"
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.done.is_set() or self.finishing or len(self.inputs) + len(self.failed) < len(self.members):
            return
        if self.failed:
            self.done.set()
            return
        # Aggregating and re-encoding a large span takes a while: do it off the event loop, so
        # the streams of other calls (and of this one) keep moving meanwhile.
        self.finishing = True
        asyncio.get_running_loop().create_task(self._finalize())

    async def _finalize(self) -> None:
        try:
            await asyncio.to_thread(self.finalize, self)
        except Exception as err:  # noqa: BLE001 - an aggregation failure aborts the attempt
            self.failed["*"] = f"aggregation failed: {err}"
        finally:
            self.done.set()


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
        self.attempts.pop((round_id, key), None)
        self.current.pop((round_id, key), None)

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
        except asyncio.TimeoutError:
            return None
        if rk in self.done:
            return None
        atts = self.attempts.get(rk, {})
        return atts.get(number) or atts.get(self.current[rk])


# --- validation of one member's input ----------------------------------------------------------


def validate_span(
    codec: Codec, span_len: int, limits: WireLimits
) -> Callable[[str, peer_pb2.Payload], object]:
    """A reduce input: one wire tensor of this codec, decoding to float32 [span_len], finite."""

    def check(sender: str, payload: peer_pb2.Payload) -> torch.Tensor:
        if len(payload.tensors) != 1:
            raise InputRejected(f"expected 1 tensor in the payload, got {len(payload.tensors)}")
        wire = wire_from_proto(payload.tensors[0], limits)
        return decode_checked(codec, wire, (span_len,))

    return check


def decode_checked(codec: Codec, wire: WireTensor, shape: tuple[int, ...]) -> torch.Tensor:
    if wire.codec != codec.name:
        raise InputRejected(f"codec {wire.codec!r}, the round uses {codec.name!r}")
    if tuple(wire.shape) != shape or wire.dtype != "float32":
        raise InputRejected(f"shape {list(wire.shape)} {wire.dtype}, expected {list(shape)} float32")
    check_finite(wire)
    try:
        out = codec.decode(wire)
    except Exception as err:  # noqa: BLE001 - a hostile payload may break the decoder in any way
        raise InputRejected(f"payload does not decode as {codec.name}: {err}") from None
    if tuple(out.shape) != shape or not bool(torch.isfinite(out).all()):
        raise InputRejected("decoded values are not finite (NaN or Inf)")
    return out


def validate_gather(
    expected: list[WireTensor], codec: Codec | None, limits: WireLimits
) -> Callable[[str, peer_pb2.Payload], object]:
    """A gather input: as many wire tensors as ours, each with our codec, shape, dtype and parts."""

    def check(sender: str, payload: peer_pb2.Payload) -> list[WireTensor]:
        if len(payload.tensors) != len(expected):
            raise InputRejected(f"{len(payload.tensors)} tensors, the round has {len(expected)}")
        out = []
        for i, (msg, ours) in enumerate(zip(payload.tensors, expected, strict=True)):
            w = wire_from_proto(msg, limits)
            if (w.codec, tuple(w.shape), w.dtype) != (ours.codec, tuple(ours.shape), ours.dtype):
                raise InputRejected(
                    f"tensor {i}: {w.codec} {list(w.shape)} {w.dtype}, expected "
                    f"{ours.codec} {list(ours.shape)} {ours.dtype}"
                )
            theirs = {n: (t.dtype, tuple(t.shape)) for n, t in w.parts.items()}
            if theirs != {n: (t.dtype, tuple(t.shape)) for n, t in ours.parts.items()}:
                raise InputRejected(f"tensor {i}: parts {sorted(theirs)} do not match the round's layout")
            check_finite(w, f"tensor {i}")
            if codec is not None and w.codec == codec.name:
                decode_checked(codec, w, tuple(ours.shape))
            out.append(w)
        return out

    return check


def reduce_finalizer(codec: Codec, aggregator: Aggregator) -> Callable[[Attempt], None]:
    """Aggregate the span in sorted member order, re-encode once, keep the decoded bytes."""

    def finalize(att: Attempt) -> None:
        order = sorted(att.inputs)
        weights = [att.weights[m] for m in order]
        updates = [[att.inputs[m]] for m in order]  # type: ignore[list-item]
        if sum(weights) <= 0:
            agg = [torch.zeros_like(updates[0][0])]  # only weight-0 joiners: no movement
        else:
            try:
                agg, dropped = aggregator(updates, weights)
            except AggregatorError as err:
                raise InputRejected(str(err)) from None
            if dropped:
                for i, why in dropped.items():
                    att.failed[order[i]] = why
                return
        wire = codec.encode_stateless(agg[0], f"{att.key}/span")
        att.result = codec.decode(wire)
        att.result_payload = peer_pb2.Payload(tensors=[wire_to_proto(wire)]).SerializeToString()

    return finalize


# --- the handler of one incoming Exchange stream -----------------------------------------------


@dataclass(kw_only=True, slots=True)
class ServeSettings:
    peer_timeout: float
    round_deadline: float
    max_payload_bytes: int
    chunk_bytes: int
    run_id: str
    node_id: str


def status(code: int, **kw: object) -> peer_pb2.ExchangeReply:
    return peer_pb2.ExchangeReply(
        status=peer_pb2.ExchangeStatus(code=code, protocol_version=PROTOCOL_VERSION, **kw)
    )


async def serve_exchange(book: RoundBook, settings: ServeSettings, peer_id: str, context) -> None:
    """Run one member's stream: header, payload, then the attempt's outcome (and result)."""
    s = settings
    try:
        first = await asyncio.wait_for(context.read(), s.peer_timeout)
    except asyncio.TimeoutError:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no header within {s.peer_timeout:g}s")
    if first is grpc.aio.EOF or first.WhichOneof("kind") != "header":
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the first frame of an exchange must be its header"
        )
    h = first.header
    if h.protocol_version != PROTOCOL_VERSION:
        await context.write(
            status(REFUSED, reason=str(VersionMismatch(PROTOCOL_VERSION, h.protocol_version)))
        )
        return
    if h.sender != peer_id:
        await context.write(
            status(REFUSED, reason=f"header names {h.sender} but the TLS certificate is {peer_id}")
        )
        return
    if h.run_id != s.run_id:
        await context.write(status(REFUSED, reason=f"run {h.run_id!r} is not this node's run {s.run_id!r}"))
        return
    rk = (int(h.round), h.key)
    if rk in book.done:
        await context.write(status(DONE, result_hash=book.done[rk].result_hash))
        return
    att = await book.wait_attempt(rk, int(h.attempt), s.peer_timeout)
    if att is None:
        if rk in book.done:
            await context.write(status(DONE, result_hash=book.done[rk].result_hash))
        else:  # the owner itself is the one missing: the caller drops it, not its own input
            why = f"did not start round {rk[0]} {rk[1]!r} within {s.peer_timeout:g}s"
            await context.write(status(ABORT, reason=why, failed={s.node_id: why}))
        return
    if att.number != h.attempt:
        await context.write(
            status(
                ABORT,
                reason=f"attempt {h.attempt} is over here; now at attempt {att.number}",
                members=list(att.members),
                attempt=att.number,
            )
        )
        return
    if peer_id in att.members and tuple(h.members) != att.members:
        why = f"member lists differ ({peer_id} has {len(h.members)}, this peer {len(att.members)})"
        att.disagree(why)
        await context.write(status(ABORT, reason=why, members=list(att.members), attempt=att.number))
        return
    reason = _header_problem(att, h, peer_id, s)
    if reason:
        att.reject(peer_id, reason)
        await context.write(status(REFUSED, reason=reason, members=list(att.members), attempt=att.number))
        return
    att.started.add(peer_id)
    try:
        value = await _read_input(att, h, context, s)
    except InputRejected as err:
        att.reject(peer_id, str(err))
        await context.write(status(REFUSED, reason=str(err), attempt=att.number))
        return
    except BaseException:  # the caller vanished mid-stream (its RPC was cancelled): drop it, re-raise
        att.reject(peer_id, "connection lost while sending its input")
        raise
    att.add(peer_id, value, float(h.weight))
    await att.done.wait()
    if book.stalled.is_set():
        await asyncio.sleep(s.round_deadline * 10)  # injected: a stalled machine never answers
    if att.failed:
        await context.write(status(ABORT, failed=att.failed, members=list(att.members), attempt=att.number))
        return
    await context.write(status(OK, contributors=sorted(att.inputs), payload_bytes=len(att.result_payload)))
    if att.op == peer_pb2.OP_REDUCE:
        for piece in split(att.result_payload, s.chunk_bytes):
            await context.write(peer_pb2.ExchangeReply(data=piece))


def _header_problem(att: Attempt, h: peer_pb2.ExchangeHeader, peer_id: str, s: ServeSettings) -> str:
    if peer_id not in att.members:
        return f"{peer_id} is not a member of round {att.round_id} attempt {att.number}"
    if h.op != att.op:
        return "operation differs (reduce vs gather)"
    if h.layout_hash != att.layout:
        return "tensor layout (codec, shapes, dtypes) differs from this peer's"
    if (h.span_start, h.span_end) != att.span:
        return f"span [{h.span_start}, {h.span_end}) is not the span this peer owns {list(att.span)}"
    if not math.isfinite(h.weight) or h.weight < 0:
        return f"weight {h.weight} is not a finite non-negative number"
    if h.payload_bytes < 0 or h.payload_bytes > s.max_payload_bytes:
        return f"payload of {h.payload_bytes} bytes is over the limit of {s.max_payload_bytes}"
    return ""


async def _read_input(att: Attempt, h: peer_pb2.ExchangeHeader, context, s: ServeSettings) -> object:
    buf = bytearray()
    while len(buf) < h.payload_bytes or (h.payload_bytes == 0 and not buf):
        try:
            frame = await asyncio.wait_for(context.read(), s.peer_timeout)
        except asyncio.TimeoutError:
            raise InputRejected(f"stalled: no data for {s.peer_timeout:g}s") from None
        if frame is grpc.aio.EOF:
            if h.payload_bytes == 0:
                break
            raise InputRejected(f"stream ended after {len(buf)} of {h.payload_bytes} bytes")
        if frame.WhichOneof("kind") != "data":
            raise InputRejected("a second header in one stream")
        buf += frame.data
        if len(buf) > h.payload_bytes:
            raise InputRejected(f"sent more than the {h.payload_bytes} bytes it declared")
        if h.payload_bytes == 0:
            break
    att.bytes_received += len(buf)
    try:
        payload = peer_pb2.Payload.FromString(bytes(buf))
    except DecodeError as err:
        raise InputRejected(f"malformed payload (not a murmur.v1.Payload): {err}") from None
    try:
        return await asyncio.to_thread(att.validate, h.sender, payload)
    except (WireError, InputRejected) as err:
        raise InputRejected(str(err)) from None
