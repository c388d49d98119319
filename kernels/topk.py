"""Chunked top-k by magnitude with compact within-chunk indices, and the scatter back.

Semantics: x.flatten() is cut into chunks of `chunk` elements (the last one padded with
elements that rank below every real element, zeros included). From each chunk the k entries of
largest |x| are kept, ordered by decreasing |x|, ties to the lower index.
  values  [n_chunks, k]  x's dtype, signed original values (0 for a padding pick)
  indices [n_chunks, k]  position within the chunk; int16 when chunk <= 32768, else int32
A padding pick (only when the last chunk holds fewer than k real elements) has an index
>= the chunk's real length and value 0; `scatter_topk` drops it. Indices of one chunk are
distinct, so the scatter has no write conflicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import KernelError, cdiv, lazy_jit, next_pow2, write_out

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl

INT16_MAX_CHUNK = 32768


def index_dtype(chunk: int) -> torch.dtype:
    return torch.int16 if chunk <= INT16_MAX_CHUNK else torch.int32


def check_args(k: int, chunk: int) -> None:
    if chunk < 1 or not 1 <= k <= chunk:
        raise KernelError(f"top-k needs 1 <= k <= chunk, got k={k}, chunk={chunk}")


def topk_ref(x: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(k, chunk)
    flat = x.reshape(-1)
    n = flat.numel()
    rows = cdiv(n, chunk)
    mag = torch.nn.functional.pad(flat.abs().float(), (0, rows * chunk - n), value=-1.0).view(rows, chunk)
    idx = torch.sort(mag, dim=1, descending=True, stable=True).indices[:, :k]
    padded = torch.nn.functional.pad(flat, (0, rows * chunk - n)).view(rows, chunk)
    return padded.gather(1, idx), idx.to(index_dtype(chunk))


def scatter_ref(values, indices, chunk, shape, out=None, accumulate=False):
    n = int(torch.Size(shape).numel())
    rows = cdiv(n, chunk)
    dense = torch.zeros(rows * chunk, dtype=values.dtype, device=values.device)
    pos = (torch.arange(rows, device=values.device)[:, None] * chunk + indices.long()).reshape(-1)
    dense[pos] = values.reshape(-1)  # distinct positions; padding picks land beyond n
    vals = dense[:n].view(shape)
    return write_out(vals, out, accumulate)


@lazy_jit
def _topk_kernel(X, VALS, IDX, n, chunk, k, CHUNK_P2: tl.constexpr):
    # Sort one key per element: |x| as its (monotonic) fp32 bit pattern + 1 in the high word,
    # the reversed lane in the low word (ties go to the lower index). Padding keys have a zero
    # high word and so rank below every real element, |x| = 0 included.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK_P2)
    valid = (cols < chunk) & (row * chunk + cols < n)
    x = tl.load(X + row * chunk + cols, mask=valid, other=0.0).to(tl.float32)
    mag = tl.abs(x).to(tl.int32, bitcast=True).to(tl.int64) + 1
    low = (CHUNK_P2 - 1 - cols).to(tl.int64)
    key = tl.where(valid, (mag << 32) | low, low)
    key = tl.sort(key, descending=True)
    idx = (CHUNK_P2 - 1) - (key & (CHUNK_P2 - 1))   # the low word (< CHUNK_P2 <= 2^31)
    keep = cols < k
    src_ok = keep & (idx < chunk) & (row * chunk + idx < n)
    val = tl.load(X + row * chunk + idx, mask=src_ok, other=0.0)
    tl.store(VALS + row * k + cols, val, mask=keep)
    tl.store(IDX + row * k + cols, idx.to(IDX.dtype.element_ty), mask=keep)


@lazy_jit
def _scatter_kernel(VALS, IDX, OUT, n, chunk, k, ACC: tl.constexpr, K_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_P2)
    keep = j < k
    idx = tl.load(IDX + row * k + j, mask=keep, other=0).to(tl.int64)
    val = tl.load(VALS + row * k + j, mask=keep, other=0.0).to(tl.float32)
    pos = row * chunk + idx
    ok = keep & (idx < chunk) & (pos < n)
    if ACC:
        val += tl.load(OUT + pos, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + pos, val.to(OUT.dtype.element_ty), mask=ok)


def topk_triton(x: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(k, chunk)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    rows = cdiv(n, chunk)
    vals = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    idx = torch.empty(rows, k, dtype=index_dtype(chunk), device=x.device)
    if rows:
        _topk_kernel[(rows,)](flat, vals, idx, n, chunk, k, CHUNK_P2=next_pow2(chunk))
    return vals, idx


def scatter_triton(values, indices, chunk, shape, out=None, accumulate=False):
    n = int(torch.Size(shape).numel())
    rows = cdiv(n, chunk)
    if values.shape != indices.shape or values.dim() != 2 or values.shape[0] != rows:
        raise KernelError(f"scatter_topk: values {tuple(values.shape)} / indices {tuple(indices.shape)} "
                          f"do not fit {rows} chunks of {chunk} for shape {tuple(shape)}")
    if out is None:
        if accumulate:
            raise KernelError("accumulate=True needs an `out` tensor to add into")
        out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    elif not accumulate:
        out.zero_()
    if not out.is_contiguous():
        raise KernelError("scatter_topk needs a contiguous `out` tensor")
    k = values.shape[1]
    if rows and k:
        _scatter_kernel[(rows,)](values.contiguous(), indices.contiguous(), out, n, chunk, k,
                                 ACC=bool(accumulate), K_P2=next_pow2(k))
    return out
