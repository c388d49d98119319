"""Activations and their gradients on the wire between stages, and the checks on what arrives.

Codecs: ``fp32`` (exact; the equivalence tests), ``bf16`` (the default: half the bytes, the
precision the compute uses on a GPU anyway), ``int8`` (blockwise absmax through
`kernels.quantize_blockwise`, a quarter of fp32 plus one fp32 scale per block; SWARM sends 8-bit
activations too) and ``tokens`` (int64 token ids and targets, exact).

Everything decoded here is untrusted: the codec must be one we know, the shape must be the one
the caller expects (``decode(..., shape=...)``), every part must hold exactly the bytes its shape
needs, and no value may be NaN or Inf. Each refusal is a `WireError` naming the reason.
"""

from __future__ import annotations

import math

import torch

from murmur import kernels
from murmur.protocol import tensor_pb2
from murmur.protocol.runconfig import ACTIVATION_CODECS  # one list, in the run config
from murmur.protocol.wire import (
    DTYPE_NAMES,
    DTYPES,
    WireError,
    WireLimits,
    dtype_name,
    read_meta,
    tensor_bytes,
)

INT8_BLOCK = 64  # elements per absmax scale


def encode(t: torch.Tensor, codec: str) -> tensor_pb2.WireTensor:
    msg = tensor_pb2.WireTensor()
    encode_into(msg, t, codec)
    return msg


def encode_into(msg: tensor_pb2.WireTensor, t: torch.Tensor, codec: str) -> None:
    """Write ``t`` encoded with ``codec`` into ``msg``, an empty field of the request or reply that
    carries it (``request.inputs``): the bytes are copied into the message once, where building a
    separate message and assigning it copied them once more per level (upb copies a sub-message
    on assignment), twice for every activation a hop sends."""
    if t.requires_grad:
        t = t.detach()
    meta: dict[str, int] = {}
    if codec in _PLAIN:
        # One conversion into a fresh contiguous CPU tensor, its bytes taken once: a stage peer
        # calls this on its event loop while the compute thread runs, and every torch call here
        # hands the GIL over and back (a detach, reshape, contiguous and view each, before).
        dtype = _PARTS[codec]["values"]
        v = t.to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format)
        msg.codec, msg.dtype = codec, "int64" if codec == "tokens" else "float32"
        msg.shape.extend(t.shape)
        msg.parts.add(name="values", dtype=DTYPE_NAMES[dtype], shape=(v.numel(),), data=_raw_bytes(v))
        return
    if codec == "int8":
        q, scales, _ = kernels.quantize_blockwise(t.float().contiguous().reshape(-1), 8, INT8_BLOCK)
        parts, dtype, meta = {"values": q, "scales": scales}, "float32", {"block": INT8_BLOCK}
    else:
        raise WireError(f"unknown activation codec {codec!r}; known: {', '.join(ACTIVATION_CODECS)}")
    msg.codec, msg.dtype = codec, dtype
    msg.shape.extend(t.shape)
    for name, v in parts.items():
        msg.parts.add(name=name, dtype=dtype_name(v.dtype), shape=list(v.shape), data=tensor_bytes(v))
    for name, value in meta.items():
        msg.meta.add(name=name, int_value=value)


_PLAIN = ("tokens", "fp32", "bf16")  # one part, "values", of the codec's dtype


def _raw_bytes(v: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor (as `protocol.wire.tensor_bytes`; numpy has no bf16)."""
    if not v.numel():
        return b""
    return (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy().tobytes()


def decode(
    msg: tensor_pb2.WireTensor, *, shape: tuple[int, ...], what: str, limits: WireLimits = WireLimits()
) -> torch.Tensor:
    """The tensor ``msg`` carries, checked to be of ``shape``; token ids come back int64, the
    rest fp32. Raises WireError naming what is wrong.

    Read straight from the message, not through `protocol.wire.wire_from_proto`: the shape expected
    is known here, so the message's shape, its codec's parts and their dtypes are compared with it
    before any byte becomes a tensor, and each part's bytes are taken once (the general decoder's
    per-part checks and records cost a hop more than the bytes did)."""
    values, scales, block = _checked(msg, shape, what, limits)
    if scales is not None:
        return kernels.dequantize_blockwise(values, scales, 8, block, shape)
    return values.reshape(shape) if msg.codec == "tokens" else values.float().reshape(shape)


def check(msg: tensor_pb2.WireTensor, *, shape: tuple[int, ...], what: str,
          limits: WireLimits = WireLimits()) -> tensor_pb2.WireTensor:
    """``msg`` itself, once it has passed every check `decode` makes (WireError otherwise), without
    converting it: a driver hands a stage's outputs on to the next stage as they came (the next
    request copies the message), where decoding them to fp32 and encoding them again gave the
    same bytes (bf16, fp32, tokens) at the cost of two conversions a hop."""
    _checked(msg, shape, what, limits)
    return msg


def _checked(msg: tensor_pb2.WireTensor, shape: tuple[int, ...], what: str, limits: WireLimits):
    """(values, scales, block) of a message that passed every check; scales and block only for int8."""
    if not msg.ListFields():  # not ByteSize(): upb serializes the whole message to count it
        raise WireError(f"{what}: missing")
    if len(msg.parts) > limits.max_parts or len(msg.meta) > limits.max_meta:
        raise WireError(f"{what}: {len(msg.parts)} parts and {len(msg.meta)} meta entries, at most "
                        f"{limits.max_parts} and {limits.max_meta} allowed")
    if msg.dtype not in DTYPES:
        raise WireError(f"{what}: unknown tensor dtype {msg.dtype!r}")
    if tuple(msg.shape) != tuple(shape):
        raise WireError(f"{what}: shape {list(msg.shape)}, expected {list(shape)}")
    want = _PARTS.get(msg.codec)
    if want is None:
        raise WireError(f"{what}: unknown codec {msg.codec!r}; known: {', '.join(ACTIVATION_CODECS)}")
    names = [p.name for p in msg.parts]
    if sorted(names) != sorted(want):
        raise WireError(f"{what}: parts {sorted(names)} do not match codec {msg.codec!r}")
    meta = read_meta(msg, what)
    n = math.prod(shape)
    parts = {p.name: p for p in msg.parts}
    if msg.codec == "int8":
        block = meta.get("block")
        if not isinstance(block, int) or block < 1 or block > n + INT8_BLOCK:
            raise WireError(f"{what}: int8 block {block!r} is not a positive block size")
        blocks = math.ceil(n / block)
        scales = _part(parts["scales"], torch.float32, blocks, what, f"int8 needs {blocks} fp32 scales")
        values = _part(parts["values"], torch.int8, n, what, f"codec int8 needs {n} {torch.int8} values")
        return values, scales, block
    dtype = want["values"]
    values = _part(parts["values"], dtype, n, what,
                   f"token ids must be {n} int64 values" if msg.codec == "tokens"
                   else f"codec {msg.codec} needs {n} {dtype} values")
    return values, None, 0


# The parts each codec sends, with their dtypes.
_PARTS: dict[str, dict[str, torch.dtype]] = {
    "tokens": {"values": torch.int64}, "fp32": {"values": torch.float32},
    "bf16": {"values": torch.bfloat16}, "int8": {"values": torch.int8, "scales": torch.float32},
}


def _part(part: tensor_pb2.TensorPart, dtype: torch.dtype, numel: int, what: str, wrong: str) -> torch.Tensor:
    """The part's values: exactly ``numel`` elements of ``dtype`` in as many bytes, all finite."""
    if part.dtype != DTYPE_NAMES[dtype] or any(d < 0 for d in part.shape) or math.prod(part.shape) != numel:
        raise WireError(f"{what}: {wrong}")
    data = part.data
    if len(data) != numel * dtype.itemsize:
        raise WireError(f"{what}: part {part.name!r} holds {len(data)} bytes, {numel} {dtype} values are "
                        f"{numel * dtype.itemsize}")
    t = torch.frombuffer(bytearray(data), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    if numel and t.is_floating_point() and not _finite(t):
        raise WireError(f"{what}: part {part.name!r} holds NaN or Inf values")
    return t


def _finite(t: torch.Tensor) -> bool:
    """`protocol.wire.all_finite` of a non-empty 1-D part in one call less (no flattening view):
    on a stage peer's event loop each torch call hands the GIL to the compute thread and back."""
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def wire_bytes(msg: tensor_pb2.WireTensor) -> int:
    return msg.ByteSize()
