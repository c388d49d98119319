"""Payloads above one gRPC message: a stage call's request or reply as a header and byte chunks.

A Forward or Backward whose tensors do not fit the message cap (the run's
``pipeline.message_cap_mb``) goes through ForwardStream / BackwardStream (protocol/pipeline.proto):
the sender sends the message with every tensor part's bytes left out (`frames`: the header keeps
each part's dtype and shape), then those bytes in order as chunks well below the cap. The sender
holds its encoded message plus one chunk.

The receiver (`receive`) trusts nothing: before it takes a byte of data it checks the header (the
body it expects, only the tensors it expects and of the shapes it expects, each codec's parts with
their dtypes, no more elements in a part than its tensor has, the declared total under
``pipeline.max_payload_mb``), so what it then allocates is bounded by what it agreed to take.
Every chunk is checked as it arrives: a known tensor and part, at the offset where the previous
chunk stopped, whole elements, inside the declared size, and finite values for float parts. A
stream that ends with a part unfilled is refused too. The assembled message then goes through
the same decoding and checks (node/pipeline/codec.py) as one that came in a single message.
Every refusal is a `ChunkError` (a WireError) whose message is one line naming the reason;
``oversized`` says it broke a size limit (the service answers RESOURCE_EXHAUSTED, else
INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator, Mapping

import torch
from google.protobuf.message import Message

from murmur.protocol import pipeline_pb2, tensor_pb2
from murmur.protocol.wire import DTYPES, WireError

# Slack left in a frame for its header fields (tensor and part names, offset, tags).
FRAME_OVERHEAD = 4 << 10
# The part dtypes each activation codec sends (node/pipeline/codec.py).
CODEC_PARTS: dict[str, dict[str, str]] = {
    "tokens": {"values": "int64"},
    "fp32": {"values": "float32"},
    "bf16": {"values": "bfloat16"},
    "int8": {"values": "int8", "scales": "float32"},
}
_FLOAT_DTYPES = ("float32", "bfloat16")
# A refused stream is read to its end (and dropped) up to this many times the payload limit.
DRAIN_FACTOR = 16


class ChunkError(WireError):
    def __init__(self, reason: str, *, oversized: bool = False) -> None:
        super().__init__(reason)
        self.oversized = oversized


def chunk_bytes(max_message_bytes: int) -> int:
    """The data bytes of one chunk: a frame stays below the cap, and a chunk holds whole elements
    of any dtype (so each chunk can be checked on its own)."""
    return max(8, (max_message_bytes - FRAME_OVERHEAD) // 8 * 8)


def needs_stream(message_bytes: int, max_message_bytes: int) -> bool:
    return message_bytes > max_message_bytes - FRAME_OVERHEAD


def tensor_fields(msg: Message) -> list[tuple[str, tensor_pb2.WireTensor]]:
    return [(f.name, v) for f, v in msg.ListFields() if isinstance(v, tensor_pb2.WireTensor)]


def frames(msg: Message, body: str, max_message_bytes: int) -> Iterator[pipeline_pb2.StageFrame]:
    """``msg`` as a header frame (its field ``body`` of StageFrame) and then its parts' bytes in chunks."""
    header = type(msg)()
    for field, value in msg.ListFields():
        if isinstance(value, tensor_pb2.WireTensor):
            getattr(header, field.name).CopyFrom(_without_data(value))
        elif field.message_type is not None:
            getattr(header, field.name).CopyFrom(value)
        else:
            setattr(header, field.name, value)
    yield pipeline_pb2.StageFrame(**{body: header})
    size = chunk_bytes(max_message_bytes)
    for name, wt in tensor_fields(msg):
        for part in wt.parts:
            data = memoryview(part.data)
            for offset in range(0, len(data), size):
                yield pipeline_pb2.StageFrame(chunk=pipeline_pb2.PayloadChunk(
                    tensor=name, part=part.name, offset=offset, data=bytes(data[offset:offset + size])))


def _without_data(wt: tensor_pb2.WireTensor) -> tensor_pb2.WireTensor:
    out = tensor_pb2.WireTensor(codec=wt.codec, shape=wt.shape, dtype=wt.dtype, meta=wt.meta)
    for part in wt.parts:
        out.parts.add(name=part.name, dtype=part.dtype, shape=part.shape)
    return out


class _Part:
    __slots__ = ("dtype", "itemsize", "buf", "filled")

    def __init__(self, dtype: str, nbytes: int) -> None:
        self.dtype, self.itemsize = dtype, DTYPES[dtype].itemsize
        self.buf, self.filled = bytearray(nbytes), 0


def check_header(
    header: Message, expected: Mapping[str, tuple[int, ...]], max_payload_bytes: int
) -> dict[tuple[str, str], _Part]:
    """The buffers the header's parts will fill, once its tensors are those ``expected`` ({field:
    shape}), with the parts their codecs send, the declared total within ``max_payload_bytes``."""
    parts: dict[tuple[str, str], _Part] = {}
    total = 0
    declared = dict(tensor_fields(header))
    if set(declared) - set(expected):
        raise ChunkError(f"header: tensors {sorted(set(declared) - set(expected))} not expected here")
    for name, shape in expected.items():
        wt = declared.get(name)
        if wt is None:
            continue  # a missing tensor is refused where the message is decoded (codec.decode)
        if tuple(wt.shape) != tuple(shape):
            raise ChunkError(f"header: {name} has shape {list(wt.shape)}, expected {list(shape)}")
        want = CODEC_PARTS.get(wt.codec)
        if want is None:
            raise ChunkError(f"header: {name} has unknown codec {wt.codec!r}")
        got = [p.name for p in wt.parts]
        if sorted(got) != sorted(want) or len(set(got)) != len(got):
            raise ChunkError(f"header: {name} ({wt.codec}) has parts {got}, expected {sorted(want)}")
        numel = math.prod(shape)
        for part in wt.parts:
            if part.data:
                raise ChunkError(f"header: {name}.{part.name} carries data; the bytes travel as chunks")
            if part.dtype != want[part.name]:
                raise ChunkError(f"header: {name}.{part.name} is {part.dtype!r}, codec {wt.codec} sends "
                                 f"{want[part.name]}")
            if any(d < 0 for d in part.shape) or math.prod(part.shape) > numel:
                raise ChunkError(f"header: {name}.{part.name} declares shape {list(part.shape)}, more than "
                                 f"the {numel} elements of its tensor")
            nbytes = math.prod(part.shape) * DTYPES[part.dtype].itemsize
            total += nbytes
            if total > max_payload_bytes:
                raise ChunkError(f"payload declares more than {_mib(max_payload_bytes)} (pipeline.max_payload_mb)",
                                 oversized=True)
            parts[(name, part.name)] = _Part(part.dtype, nbytes)
    return parts


def add_chunk(parts: dict[tuple[str, str], _Part], chunk: pipeline_pb2.PayloadChunk, max_chunk: int) -> None:
    part = parts.get((chunk.tensor, chunk.part))
    where = f"chunk of {chunk.tensor}.{chunk.part} at byte {chunk.offset}"
    if part is None:
        raise ChunkError(f"{where}: the header declares no such part")
    n = len(chunk.data)
    if n == 0 or n > max_chunk:
        raise ChunkError(f"{where}: {n} bytes, a chunk holds 1 to {max_chunk}", oversized=n > max_chunk)
    if chunk.offset != part.filled:
        raise ChunkError(f"{where}: out of order, {part.filled} bytes of the part have arrived")
    if part.filled + n > len(part.buf):
        raise ChunkError(f"{where}: {n} bytes overrun the part's declared {len(part.buf)} bytes", oversized=True)
    if n % part.itemsize:
        raise ChunkError(f"{where}: {n} bytes are not whole {part.dtype} elements")
    if part.dtype in _FLOAT_DTYPES:
        values = torch.frombuffer(bytearray(chunk.data), dtype=DTYPES[part.dtype])
        if not bool(torch.isfinite(values).all()):
            raise ChunkError(f"{where}: NaN or Inf values")
    part.buf[part.filled:part.filled + n] = chunk.data
    part.filled += n


async def receive(
    stream: AsyncIterator[pipeline_pb2.StageFrame], body: str, expected_of, *, max_payload_bytes: int,
    max_message_bytes: int,
) -> Message:
    """The message a streamed call carries. ``expected_of(header)`` checks the header's plain fields
    (it may raise) and returns the tensors it expects, {field: shape}."""
    header = None
    parts: dict[tuple[str, str], _Part] = {}
    max_chunk = chunk_bytes(max_message_bytes)
    async for frame in stream:
        kind = frame.WhichOneof("body")
        if header is None:
            if kind != body:
                raise ChunkError(f"the stream opens with {kind or 'an empty frame'}, expected a {body} header")
            header = getattr(frame, body)
            parts = check_header(header, expected_of(header), max_payload_bytes)
        elif kind != "chunk":
            raise ChunkError(f"a {kind or 'empty'} frame after the header; only chunks may follow it")
        else:
            add_chunk(parts, frame.chunk, max_chunk)
    if header is None:
        raise ChunkError(f"the stream ended before its {body} header")
    short = [f"{t}.{p} ({part.filled} of {len(part.buf)} bytes)" for (t, p), part in parts.items()
             if part.filled != len(part.buf)]
    if short:
        raise ChunkError(f"the stream ended with parts unfilled: {', '.join(short)}")
    for name, wt in tensor_fields(header):
        for part in wt.parts:
            buf = parts.pop((name, part.name)).buf
            part.data = bytes(buf)
            del buf  # one copy of the payload at a time
    return header


async def drain(stream: AsyncIterator[pipeline_pb2.StageFrame], budget_bytes: int) -> None:
    """Read and drop what is left of a refused stream, up to ``budget_bytes`` (memory stays at one
    frame): the caller then gets the refusal's reason instead of a broken stream."""
    async for frame in stream:
        budget_bytes -= frame.ByteSize()
        if budget_bytes < 0:
            return


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"
