"""Blockwise absmax quantization to int8 / int4 with error feedback, and dequantize-accumulate.

Semantics (reference and Triton agree element for element in deterministic mode):
  v      = x + residual                      (fp32; residual optional)
  per block of `block` consecutive elements of v.flatten() (the last block may be short):
  scale  = max|v| / qmax                     (fp32; qmax = 127 for int8, 7 for int4)
  q      = clamp(floor(v * (qmax / max|v|) + r), -qmax, qmax)   (0 where max|v| == 0)
           r = 0.5 (round half up) or, with stochastic rounding, r ~ U[0, 1) per element,
           which makes E[q * scale] = v exactly (unbiased).
  new_residual = v - q * scale               (error feedback: what was not sent)
Wire: int8 -> one int8 per element, shape [n]. int4 -> two per byte, shape [ceil(n/2)] uint8:
element 2i in the low nibble of byte i, element 2i+1 in the high nibble, each stored as q + 8
(1..15; a padding nibble holds 8 = zero). int4 needs an even block so no byte straddles blocks.
Stochastic rounding draws its numbers from `seed` (Philox in Triton, torch.Generator in the
reference): the same seed gives the same codes on the same backend, not across backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import KernelError, cdiv, lazy_jit, next_pow2, write_out

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl

QMAX = {8: 127, 4: 7}
TILE = 4096          # elements per Triton program (several quantization blocks)
DEQUANT_BLOCK = 2048


def check_args(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise KernelError(f"quantization bits must be 8 or 4, not {bits}")
    if block < 1 or (bits == 4 and block % 2):
        raise KernelError(f"quantization block must be positive (and even for int4), not {block}")


def packed_numel(n: int, bits: int) -> int:
    return n if bits == 8 else cdiv(n, 2)


def _prepare(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    if residual is not None and residual.shape != x.shape:
        raise KernelError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    return x.reshape(-1)


# ---------------------------------------------------------------- reference

def quantize_ref(x, bits, block, stochastic=False, seed=None, residual=None, with_residual=None):
    check_args(bits, block)
    flat = _prepare(x, residual).float()
    v = flat + residual.reshape(-1).float() if residual is not None else flat
    n, qmax = v.numel(), QMAX[bits]
    nblocks = cdiv(n, block)
    vb = torch.nn.functional.pad(v, (0, nblocks * block - n)).view(nblocks, block)
    amax = vb.abs().amax(dim=1, keepdim=True) if n else vb.new_zeros(0, 1)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    scales = amax / qmax
    if stochastic:
        gen = torch.Generator(device=v.device).manual_seed(0 if seed is None else int(seed))
        r = torch.rand(vb.shape, generator=gen, device=v.device)
    else:
        r = 0.5
    q = torch.floor(vb * inv + r).clamp_(-qmax, qmax)
    new_res = None
    if with_residual or (with_residual is None and residual is not None):
        new_res = (vb - q * scales).reshape(-1)[:n].view(x.shape)
        if residual is not None:
            residual.copy_(new_res)
            new_res = residual
    q = q.reshape(-1)[:n].to(torch.int8)
    if bits == 4:
        nib = torch.nn.functional.pad((q + 8).to(torch.uint8), (0, n % 2), value=8).view(-1, 2)
        q = nib[:, 0] | (nib[:, 1] << 4)
    return q, scales.reshape(-1), new_res


def dequantize_ref(q, scales, bits, block, shape, out=None, accumulate=False):
    check_args(bits, block)
    n = int(torch.Size(shape).numel())
    if bits == 4:
        q = torch.stack(((q & 15).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8), dim=1).reshape(-1)[:n]
    idx = torch.arange(n, device=q.device) // block
    vals = (q.float() * scales[idx]).view(shape)
    return write_out(vals, out, accumulate)


# ---------------------------------------------------------------- Triton

@lazy_jit
def _quant_kernel(X, RES, NEW_RES, Q, S, n, nblocks, block, seed,
                  QMAX: tl.constexpr, INT4: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                  HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, STOCH: tl.constexpr):
    # A [ROWS, COLS] tile, one quantization block per row, loaded contiguously. For int4 the
    # codes are regrouped as [ROWS, COLS/2, 2] pairs and split, so that the two nibbles of a
    # byte meet in one lane and the byte store stays contiguous too.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    j = tl.arange(0, COLS)[None, :]
    off = rows * block + j
    m = (j < block) & (rows < nblocks) & (off < n)
    v = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        v += tl.load(RES + off, mask=m, other=0.0)
    amax = tl.max(tl.abs(v), axis=1)
    # max() keeps the division finite in lanes the where() then discards (padding rows).
    inv = tl.where(amax > 0, QMAX / tl.maximum(amax, 1.1754944e-38), 0.0)[:, None]
    scale = amax / QMAX
    tl.store(S + rows, scale[:, None], mask=(rows < nblocks))
    if STOCH:
        r = tl.rand(seed, off)
    else:
        r = 0.5
    q = tl.minimum(tl.maximum(tl.floor(v * inv + r), -QMAX), QMAX)
    if WRITE_RES:
        tl.store(NEW_RES + off, v - q * scale[:, None], mask=m)
    if INT4:
        lo, hi = tl.split(tl.reshape(q.to(tl.int32) + 8, [ROWS, COLS // 2, 2]))
        jb = tl.arange(0, COLS // 2)[None, :]
        boff = rows * (block // 2) + jb
        bm = (2 * jb < block) & (rows < nblocks) & (rows * block + 2 * jb < n)
        # A missing odd element (n odd) was loaded as 0 and so encodes as 8, the zero nibble.
        tl.store(Q + boff, (lo | (hi << 4)).to(tl.uint8), mask=bm)
    else:
        tl.store(Q + off, q.to(tl.int8), mask=m)


@lazy_jit
def _dequant_kernel(Q, S, OUT, n, block, INT4: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    if INT4:
        byte = tl.load(Q + off // 2, mask=mask, other=8).to(tl.int32)
        q = ((byte >> ((off % 2) * 4).to(tl.int32)) & 15) - 8
    else:
        q = tl.load(Q + off, mask=mask, other=0).to(tl.int32)
    val = q.to(tl.float32) * tl.load(S + off // block, mask=mask, other=0.0)
    if ACC:
        val += tl.load(OUT + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + off, val.to(OUT.dtype.element_ty), mask=mask)


def quantize_triton(x, bits, block, stochastic=False, seed=None, residual=None, with_residual=None):
    check_args(bits, block)
    flat = _prepare(x, residual).contiguous()
    n = flat.numel()
    nblocks = cdiv(n, block)
    q = torch.empty(packed_numel(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    write_res = bool(with_residual or (with_residual is None and residual is not None))
    res_in = None
    if residual is not None:
        if residual.dtype != torch.float32 or not residual.is_contiguous():
            raise KernelError("the error-feedback residual must be a contiguous float32 tensor")
        res_in = residual.view(-1)
    new_res = (res_in if res_in is not None else torch.empty(n, dtype=torch.float32, device=x.device)) \
        if write_res else None
    if n:
        cols = max(2, next_pow2(block))
        rows = max(1, min(next_pow2(nblocks), TILE // cols))
        # The residual is read and rewritten by the same lane, so updating it in place is safe.
        _quant_kernel[(cdiv(nblocks, rows),)](
            flat, res_in if res_in is not None else flat, new_res if new_res is not None else flat,
            q, scales, n, nblocks, block, 0 if seed is None else int(seed),
            QMAX=QMAX[bits], INT4=bits == 4, ROWS=rows, COLS=cols, HAS_RES=res_in is not None,
            WRITE_RES=write_res, STOCH=bool(stochastic))
    if new_res is not None:
        new_res = residual if residual is not None else new_res.view(x.shape)
    return q, scales, new_res


def dequantize_triton(q, scales, bits, block, shape, out=None, accumulate=False):
    check_args(bits, block)
    n = int(torch.Size(shape).numel())
    if out is None:
        if accumulate:
            raise KernelError("accumulate=True needs an `out` tensor to add into")
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    if not out.is_contiguous():
        raise KernelError("dequantize_blockwise needs a contiguous `out` tensor")
    if n:
        _dequant_kernel[(cdiv(n, DEQUANT_BLOCK),)](q, scales, out, n, block, INT4=bits == 4,
                                                    ACC=bool(accumulate), BLOCK=DEQUANT_BLOCK)
    return out
