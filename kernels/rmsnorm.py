"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dimension.

Three layers: the pure-torch reference (oracle and CPU path), the Triton kernels with their
launchers, and a forward/backward pair of `training_op`s (dispatch.py) with an autograd
registration, so torch.compile traces into the fused path.

`out_dtype` lets the norm write its output straight in the dtype its consumer casts to (under
autocast the residual stream is fp32 and the next matmul reads bf16): one rounding, the same
values as norm-then-cast, and half the bytes written and read back.

Both kernels take ROWS rows per program as one [ROWS, BLOCK_N] tile, so a program has several
rows' loads in flight (one 768-wide row is only 1.5-3 KB). The backward's weight gradient is a
two-level reduction: each program sums dy * xhat over its tiles in registers, and a second pass
(torch) sums the [programs, N] partials: no atomics, deterministic.
"""

from __future__ import annotations

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
    x = tl.load(X + rows * N + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + rows * N + cols, (x * rstd[:, None] * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + r, rstd, mask=r < M)


@lazy_jit
def _rms_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program pid walks row tiles pid, pid + P, ... and keeps its share of dw in registers.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS
    for _ in range(pid, tl.cdiv(M, ROWS), n_prog):
        r = first + tl.arange(0, ROWS)
        rows = r[:, None]
        mask = (rows < M) & cmask
        x = tl.load(X + rows * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=r < M, other=0.0)[:, None]
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=1)[:, None] / N
        tl.store(DX + rows * N + cols, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        first += n_prog * ROWS
    tl.store(DW_PART + pid.to(tl.int64) * N + cols, tl.sum(dw, axis=0)[None, :], mask=cmask)


def _tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps): about 4K elements a program, at least one row. Measured on an
    H200 for 16384 x 768 (fp32 or bf16 in): 4 rows and 4 warps were the best or within 2% of the
    best of 1-16 rows x 4/8 warps, forward and backward (programs: 1, 2, 4 per SM)."""
    block_n = next_pow2(n)
    return block_n, max(1, min(16, 4096 // block_n)), 4


def _bwd_programs(tiles: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(tiles, torch.cuda.get_device_properties(device).multi_processor_count * 2))
    return max(1, min(tiles, 4))


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
        block_n, rows, warps = _tile(n)
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
    block_n, rows, warps = _tile(n)
    progs = _bwd_programs(cdiv(m, rows), x.device)
    part = torch.empty(progs, n, dtype=torch.float32, device=x.device)
    _rms_bwd_kernel.launch((progs,), dy2, x2, weight.contiguous(), rstd, dx, part, m, n,
                           ROWS=rows, BLOCK_N=block_n, num_warps=warps)
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
