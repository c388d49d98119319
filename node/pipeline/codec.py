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
from murmur.optim.wire import WireTensor
from murmur.protocol import tensor_pb2
from murmur.protocol.runconfig import ACTIVATION_CODECS  # one list, in the run config
from murmur.protocol.wire import WireError, WireLimits, check_finite, wire_from_proto, wire_to_proto

INT8_BLOCK = 64  # elements per absmax scale


def encode(t: torch.Tensor, codec: str) -> tensor_pb2.WireTensor:
    t = t.detach().contiguous()
    shape = tuple(t.shape)
    if codec == "tokens":
        return wire_to_proto(WireTensor("tokens", shape, "int64", {"values": t.to(torch.int64).reshape(-1)}))
    if codec == "fp32":
        parts = {"values": t.float().reshape(-1)}
        meta: dict[str, float | int] = {}
    elif codec == "bf16":
        parts = {"values": t.to(torch.bfloat16).reshape(-1)}
        meta = {}
    elif codec == "int8":
        q, scales, _ = kernels.quantize_blockwise(t.float().reshape(-1), 8, INT8_BLOCK)
        parts, meta = {"values": q, "scales": scales}, {"block": INT8_BLOCK}
    else:
        raise WireError(f"unknown activation codec {codec!r}; known: {', '.join(ACTIVATION_CODECS)}")
    return wire_to_proto(WireTensor(codec, shape, "float32", parts, meta))


def decode(
    msg: tensor_pb2.WireTensor, *, shape: tuple[int, ...], what: str, limits: WireLimits = WireLimits()
) -> torch.Tensor:
    """The tensor ``msg`` carries, checked to be of ``shape``; token ids come back int64, the
    rest fp32. Raises WireError naming what is wrong."""
    if not msg.ListFields():  # not ByteSize(): upb serializes the whole message to count it
        raise WireError(f"{what}: missing")
    w = wire_from_proto(msg, limits)
    if w.shape != tuple(shape):
        raise WireError(f"{what}: shape {list(w.shape)}, expected {list(shape)}")
    n = math.prod(shape)
    values = w.parts.get("values")
    if values is None or set(w.parts) - {"values", "scales"}:
        raise WireError(f"{what}: parts {sorted(w.parts)} do not match codec {w.codec!r}")
    if w.codec == "tokens":
        if values.dtype != torch.int64 or values.numel() != n:
            raise WireError(f"{what}: token ids must be {n} int64 values")
        return values.reshape(shape)
    check_finite(w, what)
    expected_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}.get(w.codec)
    if expected_dtype is None:
        raise WireError(f"{what}: unknown codec {w.codec!r}; known: {', '.join(ACTIVATION_CODECS)}")
    if values.dtype != expected_dtype or values.numel() != n:
        raise WireError(f"{what}: codec {w.codec} needs {n} {expected_dtype} values")
    if w.codec != "int8":
        return values.float().reshape(shape)
    block = w.meta.get("block")
    scales = w.parts.get("scales")
    if not isinstance(block, int) or block < 1 or block > n + INT8_BLOCK:
        raise WireError(f"{what}: int8 block {block!r} is not a positive block size")
    if scales is None or scales.dtype != torch.float32 or scales.numel() != math.ceil(n / block):
        raise WireError(f"{what}: int8 needs {math.ceil(n / block)} fp32 scales")
    return kernels.dequantize_blockwise(values, scales, 8, block, shape)


def wire_bytes(msg: tensor_pb2.WireTensor) -> int:
    return msg.ByteSize()
