"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over the last dimension.

Three layers: the pure-torch reference (oracle and CPU path), the Triton kernels with their
launchers, and a `torch.library.custom_op` pair (forward, backward) with fake and autograd
registrations so the fused path also runs under `torch.compile`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import lazy_jit, next_pow2

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@lazy_jit
def _rms_fwd_kernel(X, W, Y, RSTD, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@lazy_jit
def _rms_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, M, N, BLOCK_N: tl.constexpr):
    # Each program walks rows pid, pid + P, ... and keeps its share of dw in registers; the
    # partial sums (one row per program) are reduced by torch afterwards: no atomics, deterministic.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row = pid.to(tl.int64)
    for _ in range(pid, M, n_prog):
        base = row * N
        x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=0) / N
        tl.store(DX + base + cols, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        row += n_prog
    tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw, mask=mask)


def _bwd_programs(m: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(m, torch.cuda.get_device_properties(device).multi_processor_count * 4))
    return max(1, min(m, 4))


@torch.library.custom_op("murmur::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.numel():
        _rms_fwd_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, rstd, n, eps, BLOCK_N=next_pow2(n))
    return y.view(x.shape), rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // max(x.shape[-1], 1), dtype=torch.float32)


@torch.library.custom_op("murmur::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, dy2 = x.contiguous().view(-1, n), dy.contiguous().view(-1, n)
    m = x2.shape[0]
    dx = torch.empty_like(x2)
    if m == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    progs = _bwd_programs(m, x.device)
    part = torch.empty(progs, n, dtype=torch.float32, device=x.device)
    _rms_bwd_kernel[(progs,)](dy2, x2, weight.contiguous(), rstd, dx, part, m, n, BLOCK_N=next_pow2(n))
    return dx.view(x.shape), part.sum(0).to(weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_fwd(x, weight, float(eps))[0]
