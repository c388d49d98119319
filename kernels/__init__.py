"""murmur's kernels: the one dispatch point between the pure-torch references and Triton.

Every op has a readable reference (`*_ref`, the oracle and the CPU path) and a Triton
implementation in its own module (rmsnorm, rope, glu, linear_xent, quant, topk, dct, sign).
The functions below pick one per call: Triton for CUDA tensors, the reference otherwise;
`MURMUR_KERNELS=triton|torch` forces a side (see `dispatch.py`); under torch.compile, `auto`
keeps Triton only for the model ops measured faster than Inductor's code. Nothing else in the
tree calls Triton directly. The elementwise training ops (rms_norm, rotary, swiglu) are
`torch.library.triton_op`s that torch.compile traces into; linear_cross_entropy (matmuls and one
kernel per chunk) is an opaque `custom_op`; all have fake and autograd registrations.
"""

from __future__ import annotations

import torch

from murmur.kernels import dct as _dct
from murmur.kernels import glu as _swiglu
from murmur.kernels import linear_xent as _xent
from murmur.kernels import quant as _quant
from murmur.kernels import rmsnorm as _rms
from murmur.kernels import rope as _rot
from murmur.kernels import sign as _sign
from murmur.kernels import topk as _topk
from murmur.kernels.dispatch import KernelError, compile_enabled, use_triton

__all__ = [
    "KernelError", "rms_norm", "rotary", "swiglu", "linear_cross_entropy", "quantize_blockwise",
    "dequantize_blockwise", "topk_chunked", "scatter_topk", "dct_chunked", "idct_chunked",
    "dct_basis", "sign_pack", "sign_unpack", "use_triton", "compile_enabled",
]

dct_basis = _dct.dct_basis

# ---------------------------------------------------------------- model ops (forward and backward)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32, returned in `out_dtype`
    (default x's dtype; fp32, bf16 or fp16)."""
    if use_triton(x, weight, op="rms_norm"):
        return _rms.rms_norm_triton(x, weight, eps, out_dtype)
    return _rms.rms_norm_ref(x, weight, eps, out_dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [T, D/2]. Half-split layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).

    The fused path differentiates x only (cos and sin are constant tables).
    """
    if use_triton(x, cos, sin, op="rotary"):
        return _rot.rotary_triton(x, cos, sin)
    return _rot.rotary_ref(x, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    if use_triton(gate, up, op="swiglu"):
        return _swiglu.swiglu_triton(gate, up)
    return _swiglu.swiglu_ref(gate, up)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (hidden [N, D], weight [V, D]).

    Targets equal to `ignore_index` count neither in the sum nor in the mean (NaN if all are).
    The fused path never materializes the full [N, V] logits (see `linear_xent.py`).
    """
    if use_triton(hidden, weight, targets, op="linear_cross_entropy"):
        return _xent.linear_cross_entropy_triton(hidden, weight, targets, ignore_index)
    return _xent.linear_cross_entropy_ref(hidden, weight, targets, ignore_index)


# ---------------------------------------------------------------- compression ops (no autograd)


def quantize_blockwise(
    x: torch.Tensor, bits: int, block: int, stochastic: bool = False, seed: int | None = None,
    residual: torch.Tensor | None = None, with_residual: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blockwise absmax quantization of x (+ residual) -> (q, scales, new_residual).

    q: int8 [n] for bits=8, uint8 [ceil(n/2)] for bits=4 (two per byte, low nibble first, q+8);
    scales: fp32 [ceil(n/block)] with dequant = q * scale. `residual` (fp32, x's shape, optional)
    is the error-feedback state: the op quantizes v = x + residual and, in the same pass, writes
    e' = v - dequant(quant(v)) back INTO `residual` and returns it as new_residual. Without a
    residual, new_residual is None unless with_residual=True (then it is a fresh fp32 tensor).
    stochastic=True rounds up with probability equal to the fraction (unbiased), drawing from
    `seed` (int; same seed -> same codes on one backend). Full semantics: `quant.py`.
    """
    impl = _quant.quantize_triton if use_triton(x) else _quant.quantize_ref
    return impl(x, bits, block, stochastic, seed, residual, with_residual)


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, shape: tuple[int, ...] | torch.Size,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """q * scale reshaped to `shape` (fp32 unless `out` is given). With `out`: writes into it, or
    adds to it with accumulate=True (out += dequant), converting to out's dtype."""
    impl = _quant.dequantize_triton if use_triton(q, scales) else _quant.dequantize_ref
    return impl(q, scales, bits, block, shape, out, accumulate)


def topk_chunked(x: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk of `chunk` elements of x.flatten(), the k entries of largest |x|.

    Returns (values [n_chunks, k] in x's dtype, indices [n_chunks, k] within the chunk: int16 for
    chunk <= 32768, else int32), ordered by decreasing |x|, ties to the lower index. If the last
    chunk is short and has fewer than k elements, the extra picks have value 0 and an index past
    the end (scatter_topk drops them). Full semantics: `topk.py`.
    """
    impl = _topk.topk_triton if use_triton(x) else _topk.topk_ref
    return impl(x, k, chunk)


def scatter_topk(
    values: torch.Tensor, indices: torch.Tensor, chunk: int, shape: tuple[int, ...] | torch.Size,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """The dense tensor of `shape` holding `values` at their chunk positions, zeros elsewhere.

    With `out` and accumulate=True adds into it (call once per peer, in a fixed order, for a
    deterministic sum); with `out` and accumulate=False overwrites it (zeros elsewhere).
    """
    impl = _topk.scatter_triton if use_triton(values) else _topk.scatter_ref
    return impl(values, indices, chunk, shape, out, accumulate)


def dct_chunked(x: torch.Tensor, chunk: int, dims: int = 1) -> torch.Tensor:
    """Orthonormal DCT-II over chunks: dims=1 -> [n_chunks, chunk] over x.flatten();
    dims=2 (x 2-D) -> [n_tiles, chunk*chunk] over chunk x chunk tiles. fp32. See `dct.py`."""
    impl = _dct.dct_triton if use_triton(x) else _dct.dct_ref
    return impl(x, chunk, dims)


def idct_chunked(
    coeffs: torch.Tensor, chunk: int, shape: tuple[int, ...] | torch.Size, dims: int = 1
) -> torch.Tensor:
    """Inverse of `dct_chunked`: the fp32 tensor of `shape` (padding cropped)."""
    impl = _dct.idct_triton if use_triton(coeffs) else _dct.idct_ref
    return impl(coeffs, chunk, shape, dims)


def sign_pack(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit signs, 8 per byte LSB first (1 where x >= 0), and per-block mean |x| scales (fp32).
    Returns (bits uint8 [ceil(n/8)], scales [ceil(n/block)]); block is a multiple of 8."""
    impl = _sign.sign_pack_triton if use_triton(x) else _sign.sign_pack_ref
    return impl(x, block)


def sign_unpack(
    bits: torch.Tensor, scales: torch.Tensor, block: int, shape: tuple[int, ...] | torch.Size,
    out: torch.Tensor | None = None, accumulate: bool = False,
) -> torch.Tensor:
    """+scale where the bit is 1, -scale where 0, shaped `shape` (fp32 unless `out`; accumulate adds)."""
    impl = _sign.sign_unpack_triton if use_triton(bits, scales) else _sign.sign_unpack_ref
    return impl(bits, scales, block, shape, out, accumulate)
