"""Checks of one member's input (or one owner's result) before a byte of it is used.

The header was checked already (node/exchange/collect.py); here the payload: protobuf, dtypes,
shapes and part sizes (protocol/wire.py), the codec, NaN/Inf in the parts and in the decoded
values. A refusal is an ``InputRejected`` whose message is the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from google.protobuf.message import DecodeError

from murmur.errors import MurmurError
from murmur.optim.codecs import Codec
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2
from murmur.protocol.wire import WireError, WireLimits, check_finite, wire_from_proto


class InputRejected(MurmurError):
    """One member's input cannot be used in this attempt; the message is the reason."""


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


def decode_chunk(codec: Codec, data: bytes, length: int, limits: WireLimits) -> torch.Tensor:
    """One chunk of a reduce (an input, or a reduced result): a serialized Payload holding one
    wire tensor of this codec that decodes to float32 [length], finite. Runs in a worker thread."""
    try:
        payload = peer_pb2.Payload.FromString(data)
    except DecodeError as err:
        raise InputRejected(f"malformed payload (not a murmur.v1.Payload): {err}") from None
    if len(payload.tensors) != 1:
        raise InputRejected(f"expected 1 tensor in the payload, got {len(payload.tensors)}")
    try:
        wire = wire_from_proto(payload.tensors[0], limits)
        return decode_checked(codec, wire, (length,))
    except WireError as err:
        raise InputRejected(str(err)) from None


def validate_gather(
    expected: list[WireTensor], codec: Codec | None, limits: WireLimits, ragged: bool = False
) -> Callable[[str, peer_pb2.Payload], list[WireTensor]]:
    """A gather input: as many wire tensors as ``expected``, each with its codec, shape, dtype and
    parts; ``ragged``: or empty (no element, every part empty), a slot its sender leaves unused
    (node/exchange/hierarchy.py's phase C: owners hold blocks of different sizes)."""

    def check(sender: str, payload: peer_pb2.Payload) -> list[WireTensor]:
        if len(payload.tensors) != len(expected):
            raise InputRejected(f"{len(payload.tensors)} tensors, the round has {len(expected)}")
        out = []
        for i, (msg, ours) in enumerate(zip(payload.tensors, expected, strict=True)):
            w = wire_from_proto(msg, limits)
            if ragged and _empty(w) and (w.codec, w.dtype) == (ours.codec, ours.dtype):
                out.append(w)
                continue
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


def _empty(w: WireTensor) -> bool:
    return tuple(w.shape) == (0,) and all(t.numel() == 0 for t in w.parts.values())
