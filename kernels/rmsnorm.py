"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dimension.

Three layers: the pure-torch reference (oracle and CPU path), the Triton kernels with their
launchers, and a forward/backward pair of `training_op`s (dispatch.py) with an autograd
registration, so torch.compile traces into the fused path.

`out_dtype` lets the norm write its output straight in the dtype its consumer casts to (under
autocast the residual stream is fp32 and the next matmul reads bf16): one rounding, the same
values as norm-then-cast, and half the bytes written and read back.

The forward takes ROWS rows per program as one [ROWS, BLOCK_N] tile and streams x past the cache
(evict_first: it is read once), keeping the weight resident (evict_last). The backward splits the
rows into SPLIT-row slices, one program each (several per SM), and walks its slice ROWS rows at a
time in a software-pipelined loop (`tl.range(num_stages=...)`: the next tile's loads are in flight
while this one computes), writing dx and summing its share of dw in registers; a second pass
(torch) sums the [programs, N] partials: no atomics, deterministic. This is the schedule Inductor
generates for the reference's backward ("mix-order reduction"); the earlier persistent loop (two
programs per SM walking strided tiles) lost to it by ~10% on an H200 (benchmarks/results/kernels.json).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import cdiv, lazy_jit, next_pow2, training_op

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(out_dtype or x.dtype)


@lazy_jit
def _rms_fwd_kernel(X, W, Y, RSTD, M, N, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rows = r[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M) & (cols < N)
    x = tl.load(X + rows * N + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(Y + rows * N + cols, (x * rstd[:, None] * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + r, rstd, mask=r < M)


@lazy_jit
def _rms_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, M, N, SPLIT: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    # Program pid owns rows [pid * SPLIT, (pid + 1) * SPLIT) and writes its share of dw.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    dw = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * SPLIT
    for i in tl.range(0, SPLIT, ROWS, num_stages=STAGES):
        r = first + i + tl.arange(0, ROWS)
        rows = r[:, None]
        mask = (rows < M) & cmask
        x = tl.load(X + rows * N + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(DY + rows * N + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        rstd = tl.load(RSTD + r, mask=r < M, other=0.0)[:, None]
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=1)[:, None] / N
        tl.store(DX + rows * N + cols, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)[None, :]
    tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw, mask=cmask)


def _fwd_tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps): ~2K elements and one warp per 1K columns a program. On an H200
    for 16384 x 768 bf16 (runs of 1-16 rows x 1-8 warps, with and without evict_first), 2 rows
    and 1 warp was the fastest, 13.40 us against Inductor's 13.70 us; every one of the ten
    fastest streamed x with evict_first."""
    block_n = next_pow2(n)
    return block_n, max(1, 2048 // block_n), max(1, min(8, block_n // 1024))


@functools.cache
def _sm_count(index: int) -> int:
    """The device's SM count, asked once (the backward's launch reads it at every call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _bwd_launch(m: int, n: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, SPLIT, ROWS, num_warps, stages). SPLIT: rows per program, so that there are about
    8 programs per SM (Inductor took 16 rows for 16384 rows on the H200's 132 SMs). On the H200,
    16384 x 768 bf16 fwd+bwd, of 24 launches (split 8-64, rows 1-4, warps 2-8, stages 1-4) the
    fastest was split 16, 2 rows, 4 warps, 4 stages: 82.4 us against compile's 82.3 us."""
    block_n = next_pow2(n)
    sms = 4
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    rows = max(1, min(4, 2048 // block_n))
    split = max(rows, min(64, next_pow2(cdiv(m, 8 * sms))))
    return block_n, split, rows, max(1, min(8, block_n // 256)), 4


def _out_dtype(x: torch.Tensor, code: int) -> torch.dtype:
    return x.dtype if code < 0 else _DTYPES[code]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@training_op("murmur::rms_norm_fwd")
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """out_dtype: an index into _DTYPES, or -1 for x's dtype (op schemas take no dtype)."""
    n = int(x.shape[-1])
    x2 = x.contiguous().view(-1, n)
    m = x2.shape[0]
    y = torch.empty(x2.shape, dtype=_out_dtype(x, out_dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block_n, rows, warps = _fwd_tile(n)
        _rms_fwd_kernel.launch((cdiv(m, rows),), x2, weight.contiguous(), y, rstd, m, n, eps,
                               ROWS=rows, BLOCK_N=block_n, num_warps=warps)
    return y.view(x.shape), rstd


@training_op("murmur::rms_norm_bwd")
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(x.shape[-1])
    x2, dy2 = x.contiguous().view(-1, n), dy.contiguous().view(-1, n)
    m = x2.shape[0]
    dx = torch.empty_like(x2)
    if m == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    block_n, split, rows, warps, stages = _bwd_launch(m, n, x.device)
    progs = cdiv(m, split)
    part = torch.empty(progs, n, dtype=torch.float32, device=x.device)
    _rms_bwd_kernel.launch((progs,), dy2, x2, weight.contiguous(), rstd, dx, part, m, n,
                           SPLIT=split, ROWS=rows, BLOCK_N=block_n, STAGES=stages, num_warps=warps)
    return dx.view(x.shape), part.sum(0).to(weight.dtype)


def _setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    code = -1 if out_dtype is None or out_dtype == x.dtype else _DTYPES.index(out_dtype)
    return rms_norm_fwd(x, weight, float(eps), code)[0]
