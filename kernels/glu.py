"""SwiGLU: silu(gate) * up, elementwise, computed in fp32 and rounded once to the input dtype.

The forward and backward are `training_op`s (dispatch.py), so torch.compile traces into them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from murmur.kernels.dispatch import cdiv, lazy_jit, training_op

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl

BLOCK = 1024


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@lazy_jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    g = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + off, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + off, y.to(Y.dtype.element_ty), mask=mask)


@lazy_jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + off, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig * (1 + g * (1 - sig))
    tl.store(DG + off, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + off, (dy * silu).to(DU.dtype.element_ty), mask=mask)


@training_op("murmur::swiglu_fwd")
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel.launch((cdiv(n, BLOCK),), gate, up, y, n, BLOCK=BLOCK)
    return y


@training_op("murmur::swiglu_bwd")
def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg = torch.empty_like(gate, memory_format=torch.contiguous_format)
    du = torch.empty_like(up, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel.launch((cdiv(n, BLOCK),), dy, gate, up, dg, du, n, BLOCK=BLOCK)
    return dg, du


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(dy, gate, up)


swiglu_fwd.register_autograd(_backward, setup_context=_setup)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        from murmur.kernels.dispatch import KernelError

        raise KernelError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                          f"{up.dtype} must match")
    return swiglu_fwd(gate, up)
