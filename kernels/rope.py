"""Rotary position embedding, half-split layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).

x is [B, T, H, D]; cos and sin are [T, D/2] tables (fp32 buffers of the model, never trained,
so only x gets a gradient). The backward is the same rotation by -angle, one kernel for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import lazy_jit, next_pow2, training_op

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@lazy_jit
def _rotary_kernel(X, COS, SIN, Y, T, H, HALF, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   INVERSE: tl.constexpr):
    # One program per (b, t) position: all heads of that position share one row of cos/sin.
    pos = tl.program_id(0).to(tl.int64)
    t = pos % T
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (cols < HALF)
    c = tl.load(COS + t * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    off = pos * H * 2 * HALF + heads * 2 * HALF + cols
    x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + off, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + off + HALF, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


@training_op("murmur::rotary")
def rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    b, t, h, d = x.shape
    x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        half = int(d) // 2
        _rotary_kernel.launch((b * t,), x, cos.contiguous(), sin.contiguous(), y, t, h, half,
                              BLOCK_H=next_pow2(int(h)), BLOCK_D=next_pow2(half), INVERSE=inverse)
    return y


def _setup(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rotary_op(dy, cos, sin, not ctx.inverse), None, None, None


rotary_op.register_autograd(_backward, setup_context=_setup)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotary_op(x, cos, sin, False)
