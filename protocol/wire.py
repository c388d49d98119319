"""Conversions between `optim.wire.WireTensor` and the `murmur.v1.WireTensor` message, with checks.

Everything that arrives is untrusted: ``wire_from_proto`` refuses unknown dtypes, negative or
huge shapes, byte lengths that do not match the declared shape, and too many parts, before a
single byte becomes a tensor; the caller compares codec, shape and dtype against what it expects
and checks the decoded values are finite. Each refusal is a ``WireError`` naming the reason.

Also here, because both sides must compute them identically: the hash of a set of named tensors
(a round's result, a state for late joiners) and the layout hash of a call (codec, shapes, dtypes).
This module needs torch; the coordinator does not import it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from murmur.errors import MurmurError
from murmur.optim.wire import WireTensor
from murmur.protocol import tensor_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(MurmurError):
    """A message that cannot be used as it is; the message says why."""


@dataclass(kw_only=True, slots=True, frozen=True)
class WireLimits:
    max_numel: int = 1 << 31  # elements of one part or one decoded tensor
    max_parts: int = 16  # named parts of one wire tensor
    max_dims: int = 8
    max_meta: int = 16


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel on the wire") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of ``t`` (little-endian on every platform murmur runs on)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _check_shape(shape: Sequence[int], limits: WireLimits, what: str) -> tuple[int, ...]:
    if len(shape) > limits.max_dims:
        raise WireError(f"{what}: {len(shape)} dimensions, at most {limits.max_dims} allowed")
    if any(d < 0 for d in shape):
        raise WireError(f"{what}: negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > limits.max_numel:
        raise WireError(f"{what}: {numel} elements, at most {limits.max_numel} allowed")
    return tuple(int(d) for d in shape)


def bytes_to_tensor(
    data: bytes, dtype: str, shape: Sequence[int], limits: WireLimits, what: str
) -> torch.Tensor:
    if dtype not in DTYPES:
        raise WireError(f"{what}: unknown dtype {dtype!r}")
    shape = _check_shape(shape, limits, what)
    tdtype = DTYPES[dtype]
    itemsize = 1 if tdtype == torch.bool else torch.empty((), dtype=tdtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise WireError(f"{what}: {len(data)} bytes for shape {list(shape)} {dtype} (expected {expected})")
    if not expected:
        return torch.empty(shape, dtype=tdtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if tdtype == torch.bool:
        if bool((raw > 1).any()):
            raise WireError(f"{what}: bool values other than 0 and 1")
        return raw.to(torch.bool).reshape(shape)
    return raw.view(tdtype).reshape(shape)


def tensor_to_part(name: str, t: torch.Tensor) -> tensor_pb2.TensorPart:
    return tensor_pb2.TensorPart(
        name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), data=tensor_bytes(t)
    )


def part_to_tensor(part: tensor_pb2.TensorPart, limits: WireLimits = WireLimits()) -> torch.Tensor:
    return bytes_to_tensor(part.data, part.dtype, list(part.shape), limits, f"part {part.name!r}")


def wire_to_proto(w: WireTensor) -> tensor_pb2.WireTensor:
    meta = []
    for name in sorted(w.meta):
        v = w.meta[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise WireError(f"meta {name!r} must be an int or a float, got {type(v).__name__}")
        meta.append(
            tensor_pb2.MetaEntry(name=name, int_value=v)
            if isinstance(v, int)
            else tensor_pb2.MetaEntry(name=name, float_value=v)
        )
    return tensor_pb2.WireTensor(
        codec=w.codec,
        shape=list(w.shape),
        dtype=w.dtype,
        parts=[tensor_to_part(n, t) for n, t in w.parts.items()],
        meta=meta,
    )


def wire_from_proto(msg: tensor_pb2.WireTensor, limits: WireLimits = WireLimits()) -> WireTensor:
    """A checked WireTensor; raises WireError naming the first problem."""
    if len(msg.parts) > limits.max_parts:
        raise WireError(f"{len(msg.parts)} parts, at most {limits.max_parts} allowed")
    if len(msg.meta) > limits.max_meta:
        raise WireError(f"{len(msg.meta)} meta entries, at most {limits.max_meta} allowed")
    if msg.dtype not in DTYPES:
        raise WireError(f"unknown tensor dtype {msg.dtype!r}")
    shape = _check_shape(list(msg.shape), limits, "tensor")
    parts: dict[str, torch.Tensor] = {}
    for part in msg.parts:
        if part.name in parts:
            raise WireError(f"part {part.name!r} appears twice")
        parts[part.name] = part_to_tensor(part, limits)
    return WireTensor(codec=msg.codec, shape=shape, dtype=msg.dtype, parts=parts, meta=read_meta(msg))


def read_meta(msg: tensor_pb2.WireTensor, what: str = "") -> dict[str, float | int]:
    """A wire tensor's meta entries, each set and finite (one line naming the entry otherwise);
    `what` prefixes the error, as the pipeline's activation decoder names its tensor."""
    prefix = f"{what}: " if what else ""
    meta: dict[str, float | int] = {}
    for entry in msg.meta:
        kind = entry.WhichOneof("value")
        if kind is None:
            raise WireError(f"{prefix}meta {entry.name!r} has no value")
        value = entry.int_value if kind == "int_value" else entry.float_value
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"{prefix}meta {entry.name!r} is not finite")
        meta[entry.name] = value
    return meta


def check_finite(w: WireTensor, what: str = "payload") -> None:
    """Refuse NaN/Inf in any floating part (scales included) before decoding."""
    for name, t in w.parts.items():
        if t.is_floating_point() and not all_finite(t):
            raise WireError(f"{what}: part {name!r} holds NaN or Inf values")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: its minimum and maximum are (both propagate NaN,
    and an infinity is one of them). One vectorized pass with no temporary, where
    ``isfinite(t).all()`` builds a bool tensor and costs ten times as much on the CPU: an
    activation of 64K elements took 0.2 ms, each hop of a pipeline paid it twice."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t.reshape(-1))
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def split(data: bytes, chunk_bytes: int) -> Iterator[bytes]:
    """Frames of at most ``chunk_bytes`` (at least one frame, possibly empty)."""
    if not data:
        yield b""
        return
    view = memoryview(data)
    for start in range(0, len(data), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


def tensors_hash(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """sha256 over names, dtypes, shapes and bytes, in the given order: the published state hash."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(_byte_view(t))
    return h.digest()


def _byte_view(t: torch.Tensor):
    """The bytes ``tensor_bytes`` would return, without copying a contiguous CPU tensor (a round's
    result is hashed whole: a copy would be one more update-sized buffer)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def layout_hash(
    codec: str, tensors: Iterable[tuple[Sequence[int], torch.dtype | str]], extra: str = ""
) -> bytes:
    """What every member of a call must agree on before any payload is read."""
    h = hashlib.sha256(f"{codec}|{extra}".encode())
    for shape, dtype in tensors:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        h.update(f"{list(shape)}:{name};".encode())
    return h.digest()
