"""1-bit sign packing with a per-block scale, and the unpacking (optionally accumulating).

Semantics: per block of `block` consecutive elements of x.flatten() (a multiple of 8; the last
block may be short) scale = mean |x| over the block's real elements (fp32): the scale that
minimizes the L2 error of scale * sign(x). Bit i of the stream is 1 where x_i >= 0 (so 0 and
-0 decode as +scale) and 0 where x_i < 0 or NaN. Bits pack 8 per byte, LSB first: element 8i+j
is bit j of byte i; bytes = ceil(n / 8), padding bits are 0.
Decoding: x_i ~ (+scale or -scale) of its block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import KernelError, cdiv, lazy_jit, next_pow2, write_out

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl

TILE = 4096
UNPACK_BLOCK = 2048


def check_block(block: int) -> None:
    if block < 8 or block % 8:
        raise KernelError(f"sign packing block must be a positive multiple of 8, not {block}")


def sign_pack_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(block)
    flat = x.reshape(-1).float()
    n = flat.numel()
    nblocks = cdiv(n, block)
    padded = torch.nn.functional.pad(flat.abs(), (0, nblocks * block - n)).view(nblocks, block)
    counts = torch.full((nblocks,), block, dtype=torch.float32, device=x.device)
    if n % block:
        counts[-1] = n % block
    scales = padded.sum(1) / counts
    bits = torch.nn.functional.pad((flat >= 0).to(torch.uint8), (0, cdiv(n, 8) * 8 - n)).view(-1, 8)
    weights = (1 << torch.arange(8, device=x.device)).to(torch.uint8)
    return (bits * weights).sum(1).to(torch.uint8), scales


def sign_unpack_ref(bits, scales, block, shape, out=None, accumulate=False):
    check_block(block)
    n = int(torch.Size(shape).numel())
    pos = torch.arange(n, device=bits.device)
    bit = (bits[pos // 8] >> (pos % 8).to(torch.uint8)) & 1
    vals = torch.where(bit.bool(), scales[pos // block], -scales[pos // block]).view(shape)
    return write_out(vals, out, accumulate)


@lazy_jit
def _sign_pack_kernel(X, BITS, S, n, nblocks, block, ROWS: tl.constexpr, COLS: tl.constexpr,
                      BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    # Scales: a [ROWS, COLS] tile, one block per row.
    rows = pid * ROWS + tl.arange(0, ROWS)[:, None]
    j = tl.arange(0, COLS)[None, :]
    off = rows * block + j
    m = (j < block) & (rows < nblocks) & (off < n)
    a = tl.abs(tl.load(X + off, mask=m, other=0.0).to(tl.float32))
    count = tl.sum(m.to(tl.float32), axis=1)
    tl.store(S + rows, (tl.sum(a, axis=1) / tl.maximum(count, 1.0))[:, None], mask=rows < nblocks)
    # Bits: the same elements again (now in cache) as a [BYTES, 8] tile, one byte per row.
    byte = pid * (ROWS * block // 8) + tl.arange(0, BYTES)[:, None]
    b = tl.arange(0, 8)[None, :]
    eoff = byte * 8 + b
    in_tile = tl.arange(0, BYTES)[:, None] < ROWS * block // 8
    em = in_tile & (eoff < n)
    x = tl.load(X + eoff, mask=em, other=-1.0).to(tl.float32)
    bit = tl.where(x >= 0, 1, 0) << b
    tl.store(BITS + byte, tl.sum(bit, axis=1)[:, None].to(tl.uint8), mask=in_tile & (byte * 8 < n))


@lazy_jit
def _sign_unpack_kernel(BITS, S, OUT, n, block, ACC: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    byte = tl.load(BITS + off // 8, mask=mask, other=0).to(tl.int32)
    bit = (byte >> (off % 8).to(tl.int32)) & 1
    s = tl.load(S + off // block, mask=mask, other=0.0)
    val = tl.where(bit == 1, s, -s)
    if ACC:
        val += tl.load(OUT + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + off, val.to(OUT.dtype.element_ty), mask=mask)


def sign_pack_triton(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(block)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nblocks = cdiv(n, block)
    bits = torch.empty(cdiv(n, 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n:
        cols = next_pow2(block)
        rows = max(1, min(next_pow2(nblocks), TILE // cols))
        _sign_pack_kernel[(cdiv(nblocks, rows),)](flat, bits, scales, n, nblocks, block, ROWS=rows,
                                                  COLS=cols, BYTES=next_pow2(rows * block // 8))
    return bits, scales


def sign_unpack_triton(bits, scales, block, shape, out=None, accumulate=False):
    check_block(block)
    n = int(torch.Size(shape).numel())
    if out is None:
        if accumulate:
            raise KernelError("accumulate=True needs an `out` tensor to add into")
        out = torch.empty(shape, dtype=torch.float32, device=bits.device)
    if not out.is_contiguous():
        raise KernelError("sign_unpack needs a contiguous `out` tensor")
    if n:
        _sign_unpack_kernel[(cdiv(n, UNPACK_BLOCK),)](bits, scales, out, n, block, ACC=bool(accumulate),
                                                      BLOCK=UNPACK_BLOCK)
    return out
