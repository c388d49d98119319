"""Fused linear + cross-entropy: mean CE of hidden @ weight.T without the full [N, V] logits.

The tokens are processed in chunks of `chunk` rows. For each chunk: logits = h @ W.T (one
matmul, [chunk, V]); a Triton kernel computes each row's log-sum-exp and loss and overwrites the
logits in place with d loss / d logits = (softmax - onehot) / n_valid; then grad_h = g @ W and
grad_W += g.T @ h. The gradients are computed during the forward (as Liger-Kernel does) and the
backward only scales them by the incoming grad of the loss, so peak memory is one chunk of logits
plus one fp32 [V, D] accumulator instead of several [N, V] tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from murmur.kernels.dispatch import cdiv, lazy_jit, next_pow2

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl

# Tokens per chunk: [4096, 50304] bf16 logits are ~400 MB. Each chunk reads and writes the fp32
# [V, D] weight-gradient accumulator once (~300 MB for 50304 x 768), so fewer, larger chunks pay:
# with 1024 the accumulation alone took ~2.4 ms of a 16K-token base step on an H200.
DEFAULT_CHUNK = 4096
BLOCK_V = 4096         # vocabulary tile of the softmax kernel (registers, not memory)
VOCAB_ALIGN = 64       # logits row padding (elements) for aligned matmuls


_FP32_ADDMM = "dtype_out" in torch.ops.aten.addmm.overloads()


def linear_cross_entropy_ref(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)


@lazy_jit
def _xent_kernel(LOGITS, TARGETS, LOSS, INV_N, V, stride, ignore_index, BLOCK_V: tl.constexpr,
                 GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    target = tl.load(TARGETS + row).to(tl.int64)
    # Pass 1: online max and sum of exp over the row, in fp32.
    # The running max starts finite (-3e38, not -inf) so a lane that only sees padding (-inf)
    # computes exp(-inf) = 0 rather than exp(-inf - -inf) = NaN.
    m = tl.full([BLOCK_V], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    valid = target != ignore_index
    safe_t = tl.where(valid, target, 0)
    z_t = tl.load(base + safe_t).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - z_t, 0.0))
    if GRAD:
        scale = tl.where(valid, tl.load(INV_N), 0.0)
        # Pass 2: overwrite the logits with (softmax - onehot) * scale.
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - tl.where(cols == safe_t, 1.0, 0.0)
            tl.store(base + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=cols < V)


def _fused(hidden, weight, targets, ignore_index: int, compute_grad: bool, chunk: int):
    with torch.autocast(hidden.device.type, enabled=False):
        return _fused_body(hidden, weight, targets, ignore_index, compute_grad, chunk)


def _fused_body(hidden, weight, targets, ignore_index: int, compute_grad: bool, chunk: int):
    n, d = hidden.shape
    v = weight.shape[0]
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    n_valid = (targets != ignore_index).sum()
    inv_n = 1.0 / n_valid.to(torch.float32)   # inf when every target is ignored: loss NaN, as torch
    loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
    # fp32 accumulation of the weight gradient across chunks; cast once at the end.
    # Rows of the logits padded to a multiple of VOCAB_ALIGN columns keep cuBLAS on its fast
    # (aligned) kernels for vocabularies like 50257; zero rows of W make the pad logits exactly 0,
    # the kernel never touches them, so they add nothing to grad_h, and grad_w drops them.
    v_pad = cdiv(v, VOCAB_ALIGN) * VOCAB_ALIGN
    if v_pad != v:
        weight = F.pad(weight, (0, 0, 0, v_pad - v))
    # The first chunk writes the accumulator (beta=0: cuBLAS neither reads nor needs zeros in it),
    # which saves a zero fill and a read of the ~150 MB fp32 buffer a step.
    grad_w = torch.empty(v_pad, d, dtype=torch.float32, device=hidden.device) if compute_grad else None
    block_v = min(BLOCK_V, next_pow2(v))
    for start in range(0, n, chunk):
        h = hidden[start:start + chunk]
        logits = h @ weight.t()
        _xent_kernel[(h.shape[0],)](logits, targets[start:start + chunk], loss_rows[start:start + chunk],
                                    inv_n, v, v_pad, ignore_index, BLOCK_V=block_v, GRAD=compute_grad)
        if compute_grad:
            beta = 0 if start == 0 else 1
            torch.mm(logits, weight, out=grad_h[start:start + chunk])
            if grad_w.dtype == logits.dtype:
                grad_w.addmm_(logits.t(), h, beta=beta)
            elif _FP32_ADDMM and logits.is_cuda:   # bf16 x bf16 added into fp32 by cuBLAS
                torch.addmm(grad_w, logits.t(), h, out_dtype=torch.float32, beta=beta, out=grad_w)
            elif beta:
                grad_w += logits.t() @ h
            else:
                grad_w.copy_(logits.t() @ h)
    loss = loss_rows.sum() * inv_n
    if not compute_grad:
        return loss, grad_h, weight.new_empty(0)
    return loss, grad_h, grad_w[:v].to(weight.dtype)


@torch.library.custom_op("murmur::linear_xent", mutates_args=())
def linear_xent_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
    compute_grad: bool, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fused(hidden, weight, targets, ignore_index, compute_grad, chunk)


@linear_xent_op.register_fake
def _(hidden, weight, targets, ignore_index, compute_grad, chunk):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not compute_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.compute_grad = inputs[4]


def _backward(ctx, dloss, _dgh, _dgw):
    grad_h, grad_w = ctx.saved_tensors
    if not ctx.compute_grad:
        raise RuntimeError("linear_cross_entropy ran without gradients (no_grad at forward time)")
    return grad_h * dloss.to(grad_h.dtype), grad_w * dloss.to(grad_w.dtype), None, None, None, None


linear_xent_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy_triton(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    # Under autocast the matmuls would silently change dtype inside the op (and clash with the
    # preallocated fp32 outputs): cast once here, where autograd sees the casts, and run the op
    # with autocast off.
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return linear_xent_op(hidden, weight, targets, int(ignore_index), compute_grad, int(chunk))[0]
