"""The calling side of one Exchange stream: this peer's input to one owner, and the owner's answer.

Reduce: the writer encodes the owner's span of our update chunk by chunk in a worker thread
(chunk j+1 is encoded while chunk j is on the wire) and sends one chunk per frame; at the same
time the reader takes the reduced chunks the owner streams back, decodes each in a worker thread
into the call's result buffer, and ends with the owner's status. What landed in the buffer counts
only if that status is OK and every chunk came: an aborted attempt's chunks are overwritten by the
attempt that completes. Gather: the whole payload in frames, then the owner's status.

Faults (node/net/faults.py) strike here: a NaN, a wrong shape or garbage in the first chunk, a
declared size over the limit, another protocol version, a lost result, death after (or halfway
through) sending the input.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch

from murmur.node.exchange.attempt import Attempt
from murmur.node.exchange.collect import OK
from murmur.node.exchange.settings import CHUNK_OVERHEAD, chunk_ranges
from murmur.node.exchange.snapshot import Snapshot
from murmur.node.exchange.validate import InputRejected, decode_chunk
from murmur.optim.codecs import Codec
from murmur.optim.exchange import ExchangeError
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BannedError
from murmur.protocol.version import PROTOCOL_VERSION, VERSION_METADATA_KEY
from murmur.protocol.wire import split, wire_to_proto

if TYPE_CHECKING:
    from murmur.node.exchange.grpc_exchange import GrpcExchange

ERROR = -1  # a call that produced no status at all (unreachable, refused at the door, stalled)
NAN = {"float32": b"\x00\x00\xc0\x7f", "float16": b"\x00\x7e", "bfloat16": b"\xc0\x7f"}


@dataclass(slots=True)
class Reply:
    code: int
    reason: str = ""
    failed: dict[str, str] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    attempt: int = 0
    result_hash: bytes = b""


@dataclass(slots=True)
class Call:
    """What one call needs across its attempts."""

    op: int
    round_id: int
    key: str
    weight: float
    layout: bytes
    peers: dict[str, str]
    start_members: int
    deadline: float
    numel: int = 0  # reduce: elements of the flat update
    x: torch.Tensor | None = None  # reduce: the flat update (error feedback added)
    snapshot: Snapshot | None = None  # reduce: copies ``x`` piece by piece; ask it before reading x
    result: torch.Tensor | None = None  # reduce: the flat result, filled chunk by chunk
    own: torch.Tensor | None = None  # reduce with error feedback: what our encoded input decodes to
    align: int = 1  # reduce: span and chunk boundaries
    chunk: int = 1  # reduce: elements per pipeline chunk
    gather_payload: bytes = b""  # gather: our payload, the same for everyone
    gather_wires: list[WireTensor] = field(default_factory=list)
    sent: int = 0
    received: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)  # owners our whole input reached, this attempt
    faults: set[str] = field(default_factory=set)  # injected faults that strike this call


async def call_owner(
    ex: GrpcExchange,
    call: Call,
    att: Attempt,
    owner: str,
    span: tuple[int, int],
    progress: list[float],
    sent: list[int],
    n_others: int,
) -> Reply:
    s, faults = ex.settings, call.faults
    reduce = call.op == peer_pb2.OP_REDUCE
    ranges = chunk_ranges(span[1] - span[0], call.chunk) if reduce else []
    payload = b"" if reduce else _gather_payload(call)
    declared = await asyncio.to_thread(declared_bytes, ex.codec, ranges) if reduce else len(payload)
    if "oversize" in faults:
        declared = s.max_payload_bytes + 1
    version = PROTOCOL_VERSION + 1 if "wrong_version" in faults else PROTOCOL_VERSION
    header = peer_pb2.ExchangeHeader(
        protocol_version=version,
        run_id=ex.server.run_id,
        op=call.op,
        round=call.round_id,
        key=call.key,
        attempt=att.number,
        members=list(att.members),
        sender=ex.peer_id,
        weight=call.weight,
        layout_hash=call.layout,
        span_start=span[0],
        span_end=span[1],
        payload_bytes=declared,
    )
    loop = asyncio.get_running_loop()
    rpc, tasks = None, []
    try:
        tls.check_dial(owner, ex.server.ban_list)
        stub = peer_pb2_grpc.PeerStub(ex.channel(owner, call.peers[owner]))
        rpc = stub.Exchange(
            metadata=((VERSION_METADATA_KEY, str(version)),),
            timeout=max(call.deadline - loop.time(), 0.001),
        )
        await asyncio.wait_for(rpc.write(peer_pb2.ExchangeFrame(header=header)), s.peer_timeout)
        if not reduce or "oversize" in faults:
            if "oversize" not in faults:
                for piece in split(payload, s.frame_bytes):
                    await asyncio.wait_for(rpc.write(peer_pb2.ExchangeFrame(data=piece)), s.peer_timeout)
                    progress[0] = loop.time()
                call.sent += len(payload)
            await rpc.done_writing()
            _sent_all(ex, call, owner, sent, n_others)
            if reduce:
                return await _read_reduce_reply(ex, call, owner, span, ranges, rpc, progress)
            return await _read_status(rpc, progress)
        reader = loop.create_task(_read_reduce_reply(ex, call, owner, span, ranges, rpc, progress))
        writer = loop.create_task(_write_chunks(ex, call, owner, span, ranges, rpc, progress))
        tasks = [reader, writer]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            return reader.result()  # an answer before our input was all out can only be a refusal
        err = writer.exception()
        if err is None:
            _sent_all(ex, call, owner, sent, n_others)
            return await reader
        if isinstance(err, asyncio.TimeoutError):
            return Reply(ERROR, reason=f"stalled: a write took more than {s.peer_timeout:g}s")
        if isinstance(err, ExchangeError):
            raise err
        # The stream ended under the writer: the owner answered and closed it, or the connection
        # dropped. Its status, if it sent one, says which.
        try:
            return await asyncio.wait_for(asyncio.shield(reader), s.peer_timeout)
        except TimeoutError:
            raise err from None
    except grpc.aio.AioRpcError as err:
        return Reply(ERROR, reason=f"{err.code().name}: {err.details()}")
    except asyncio.InvalidStateError:  # the callee ended the call while we were still writing
        code, details = await rpc.code(), await rpc.details()  # type: ignore[union-attr]
        return Reply(ERROR, reason=f"{code.name}: {details}")
    except TimeoutError:
        return Reply(ERROR, reason=f"stalled: a write took more than {s.peer_timeout:g}s")
    except BannedError as err:
        return Reply(ERROR, reason=str(err))
    finally:
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if rpc is not None and not rpc.done():
            rpc.cancel()


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


def _sent_all(ex: GrpcExchange, call: Call, owner: str, sent: list[int], n_others: int) -> None:
    call.delivered.add(owner)
    sent[0] += 1
    if sent[0] == n_others and "exit" in call.faults:
        ex.die("after sending its input")


# --- reduce ----------------------------------------------------------------------------------------


def encode_chunk(
    codec: Codec, piece: torch.Tensor, key: str, faults: frozenset[str], want_own: bool
) -> tuple[bytes, torch.Tensor | None]:
    """One chunk of our input as a serialized Payload (and what it decodes to, for error
    feedback). Runs in a worker thread."""
    if "nan" in faults and piece.numel():
        piece = piece.clone()
        piece[0] = float("nan")
    wire = codec.encode_stateless(piece, f"{key}/span")
    own = codec.decode(wire) if want_own and "nan" not in faults else None
    if "wrong_shape" in faults:
        wire.shape = (piece.numel() + 1,)
    payload = peer_pb2.Payload(tensors=[wire_to_proto(wire)]).SerializeToString()
    if "corrupt" in faults:
        payload = b"\xff" * max(len(payload), 1)  # field 31 with wire type 7: never a valid message
    return payload, own


async def _write_chunks(
    ex: GrpcExchange,
    call: Call,
    owner: str,
    span: tuple[int, int],
    ranges: list[tuple[int, int]],
    rpc,
    progress,
) -> None:
    s, loop, n = ex.settings, asyncio.get_running_loop(), len(ranges)
    codec, want_own, encode_one = ex.codec, call.own is not None, ex.times.wrap("encode", encode_chunk)
    first_faults = frozenset(call.faults & {"nan", "wrong_shape", "corrupt"})
    assert call.x is not None

    async def encode_when_copied(j: int):
        a, b = ranges[j]
        if call.snapshot is not None:  # the update is copied piece by piece (node/exchange/snapshot.py)
            await call.snapshot.ready(span[0] + a, span[0] + b)
        piece = call.x[span[0] + a : span[0] + b]  # type: ignore[index]
        faults = first_faults if j == 0 else frozenset()
        return await asyncio.to_thread(encode_one, codec, piece, call.key, faults, want_own)

    def encode(j: int) -> asyncio.Future:
        return asyncio.ensure_future(encode_when_copied(j))

    nxt = encode(0)
    try:
        for j, (a, b) in enumerate(ranges):
            payload, own = await nxt
            nxt = encode(j + 1) if j + 1 < n else None
            if own is not None and call.own is not None:
                call.own[span[0] + a : span[0] + b] = own
            ex.timeline.mark("in_w0", j=j, peer=owner)
            await asyncio.wait_for(rpc.write(peer_pb2.ExchangeFrame(data=payload)), s.peer_timeout)
            ex.timeline.mark("in_w1", j=j, peer=owner)
            progress[0] = loop.time()
            call.sent += len(payload)
            if "exit_midstream" in call.faults and j + 1 == max(1, n // 2):
                ex.die(f"halfway through its input ({j + 1} of {n} chunks)")
        await rpc.done_writing()
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


async def _read_reduce_reply(
    ex: GrpcExchange,
    call: Call,
    owner: str,
    span: tuple[int, int],
    ranges: list[tuple[int, int]],
    rpc,
    progress,
) -> Reply:
    """The owner's reduced chunks, decoded into the call's result as they come, then its status."""
    s, loop = ex.settings, asyncio.get_running_loop()
    codec, limits, decode = ex.codec, ex.limits, ex.times.wrap("decode_result", decode_chunk)
    got, total, lost = 0, 0, False
    decoding: asyncio.Future | None = None

    async def land() -> None:
        nonlocal decoding
        if decoding is not None:
            a, b = ranges[got - 1]
            value = await decoding
            decoding = None
            assert call.result is not None
            call.result[span[0] + a : span[0] + b] = value

    try:
        while True:
            frame = await rpc.read()
            if frame is grpc.aio.EOF:
                return Reply(ERROR, reason="closed the stream without a status")
            kind = frame.WhichOneof("kind")
            if kind == "data":
                ex.timeline.mark("res_rx", j=got, peer=owner)
                progress[0] = loop.time()
                if got >= len(ranges):
                    return Reply(ERROR, reason=f"sent more than the {len(ranges)} result chunks of its span")
                total += len(frame.data)
                if total > s.max_payload_bytes:
                    return Reply(ERROR, reason=f"its result of over {s.max_payload_bytes} bytes is over the limit")
                if "lose_result" in call.faults:  # injected: this owner's result never reaches us
                    call.faults.discard("lose_result")
                    lost = True
                await land()  # chunk got-1 decoded while chunk got was read
                if not lost:
                    a, b = ranges[got]
                    decoding = asyncio.ensure_future(
                        asyncio.to_thread(decode, codec, frame.data, b - a, limits)
                    )
                got += 1
                continue
            if kind != "status":
                return Reply(ERROR, reason="answered with an unknown frame")
            st = frame.status
            progress[0] = loop.time()
            if st.protocol_version != PROTOCOL_VERSION:
                return Reply(
                    ERROR,
                    reason=f"answers in protocol v{st.protocol_version}, this node speaks v{PROTOCOL_VERSION}",
                )
            if st.code != OK:
                return Reply(st.code, st.reason, dict(st.failed), list(st.members), st.attempt, st.result_hash)
            if got != len(ranges):
                return Reply(ERROR, reason=f"its result ended after {got} of {len(ranges)} chunks")
            if st.payload_bytes != total:
                return Reply(ERROR, reason=f"its result is {total} bytes, it declared {st.payload_bytes}")
            await land()
            if lost:
                return Reply(ERROR, reason="its result was lost (injected fault)")
            call.received += total
            return Reply(OK, members=list(st.contributors))
    except InputRejected as err:
        return Reply(ERROR, reason=f"its result was refused: {err}")
    finally:
        if decoding is not None and not decoding.done():
            decoding.cancel()


# --- gather ----------------------------------------------------------------------------------------


def _gather_payload(call: Call) -> bytes:
    payload, faults = call.gather_payload, call.faults
    if "nan" in faults or "wrong_shape" in faults:
        msg = peer_pb2.Payload.FromString(payload)
        for t in msg.tensors:
            if "wrong_shape" in faults:
                t.shape.append(1)
            for part in t.parts:
                if part.dtype in NAN and len(part.data) >= 4:
                    part.data = NAN[part.dtype] + part.data[len(NAN[part.dtype]) :]
        payload = msg.SerializeToString()
    if "corrupt" in faults:
        payload = b"\xff" * max(len(payload), 1)
    return payload


async def _read_status(rpc, progress) -> Reply:
    reply = await rpc.read()
    if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "status":
        return Reply(ERROR, reason="closed the stream without a status")
    st = reply.status
    progress[0] = asyncio.get_running_loop().time()
    if st.protocol_version != PROTOCOL_VERSION:
        return Reply(
            ERROR, reason=f"answers in protocol v{st.protocol_version}, this node speaks v{PROTOCOL_VERSION}"
        )
    return Reply(st.code, st.reason, dict(st.failed), list(st.members), st.attempt, st.result_hash)
