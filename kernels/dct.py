"""Chunked orthonormal DCT-II and its inverse, as matmuls with a cached basis (DeMo).

Basis B[k, i] = sqrt(2/c) * a_k * cos(pi * (2i + 1) * k / (2c)), a_0 = 1/sqrt(2), a_k = 1: B is
orthogonal, so the inverse is B^T and Parseval holds (sum of squares is kept).
  dims=1: x.flatten() is cut into chunks of c (zero-padded at the end) -> coefficients
          [n_chunks, c], row r = B @ chunk_r.
  dims=2: x must be 2-D [R, C]; it is cut into c x c tiles (zero-padded at the right and bottom
          edges) -> coefficients [n_tiles, c * c], tiles in row-major order, each the flattened
          B @ tile @ B^T.
`idct_chunked(coeffs, chunk, shape, dims)` inverts either layout and crops the padding, so
idct(dct(x)) == x up to rounding. The coefficient layout feeds `topk_chunked(coeffs, k, c or c*c)`
directly. The Triton path needs c to be a power of two >= 16 (DeMo uses 64); other chunk sizes
take the reference path on any device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from murmur.kernels.dispatch import KernelError, cdiv, lazy_jit

if TYPE_CHECKING:  # the kernels get `tl` from lazy_jit at first launch (see dispatch.py)
    import triton.language as tl

_BASIS: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}
ROWS_1D = 64   # chunks per Triton program in the 1-D transform


def dct_basis(
    chunk: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The [chunk, chunk] orthonormal DCT-II matrix, built in float64 once per device and dtype."""
    key = (chunk, str(device), dtype)
    if key not in _BASIS:
        k = torch.arange(chunk, dtype=torch.float64)[:, None]
        i = torch.arange(chunk, dtype=torch.float64)[None, :]
        b = torch.cos(math.pi * (2 * i + 1) * k / (2 * chunk)) * math.sqrt(2.0 / chunk)
        b[0] /= math.sqrt(2.0)
        _BASIS[key] = b.to(device=device, dtype=dtype)
    return _BASIS[key]


def check_args(x_shape, chunk: int, dims: int) -> None:
    if chunk < 1:
        raise KernelError(f"DCT chunk must be positive, not {chunk}")
    if dims not in (1, 2):
        raise KernelError(f"DCT dims must be 1 or 2, not {dims}")
    if dims == 2 and len(x_shape) != 2:
        raise KernelError(f"a 2-D chunked DCT needs a 2-D tensor, got shape {tuple(x_shape)}")


def triton_ok(chunk: int) -> bool:
    return chunk >= 16 and chunk & (chunk - 1) == 0


def _tiles(x: torch.Tensor, c: int) -> torch.Tensor:
    r, cc = x.shape
    tr, tc = cdiv(r, c), cdiv(cc, c)
    p = torch.nn.functional.pad(x, (0, tc * c - cc, 0, tr * c - r))
    return p.view(tr, c, tc, c).permute(0, 2, 1, 3).reshape(tr * tc, c, c)


def dct_ref(x: torch.Tensor, chunk: int, dims: int = 1) -> torch.Tensor:
    check_args(x.shape, chunk, dims)
    b = dct_basis(chunk, x.device)
    xf = x.float()
    if dims == 1:
        flat = xf.reshape(-1)
        rows = cdiv(flat.numel(), chunk)
        return torch.nn.functional.pad(flat, (0, rows * chunk - flat.numel())).view(rows, chunk) @ b.t()
    return (b @ _tiles(xf, chunk) @ b.t()).reshape(-1, chunk * chunk)


def idct_ref(coeffs: torch.Tensor, chunk: int, shape, dims: int = 1) -> torch.Tensor:
    shape = torch.Size(shape)
    check_args(shape, chunk, dims)
    b = dct_basis(chunk, coeffs.device)
    if dims == 1:
        return (coeffs.float().view(-1, chunk) @ b).reshape(-1)[: shape.numel()].view(shape)
    r, c = shape
    tr, tc = cdiv(r, chunk), cdiv(c, chunk)
    tiles = b.t() @ coeffs.float().view(-1, chunk, chunk) @ b
    full = tiles.view(tr, tc, chunk, chunk).permute(0, 2, 1, 3).reshape(tr * chunk, tc * chunk)
    return full[:r, :c].contiguous()


@lazy_jit
def _dct1_kernel(X, B, Y, n, C: tl.constexpr, ROWS: tl.constexpr, INVERSE: tl.constexpr):
    # Forward: Y[rows] = X[rows] @ B^T over padded chunks; inverse: X = Y @ B, cropped at n.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    j = tl.arange(0, C)[None, :]
    i = tl.arange(0, C)[:, None]
    off = rows * C + j
    if INVERSE:
        mat = tl.load(B + i * C + j)            # B[i, j]
        nrows = tl.cdiv(n, C)
        a = tl.load(X + off, mask=rows < nrows, other=0.0).to(tl.float32)
        out = tl.dot(a, mat, input_precision="ieee")
        tl.store(Y + off, out, mask=off < n)
    else:
        mat = tl.load(B + j * C + i)            # B^T[i, j] = B[j, i]
        a = tl.load(X + off, mask=off < n, other=0.0).to(tl.float32)
        out = tl.dot(a, mat, input_precision="ieee")
        tl.store(Y + off, out, mask=rows < tl.cdiv(n, C))


@lazy_jit
def _dct2_kernel(X, B, Y, R, CC, TC, C: tl.constexpr, INVERSE: tl.constexpr):
    # One c x c tile per program. Forward: Y_t = B @ T @ B^T; inverse: T = B^T @ Y_t @ B.
    t = tl.program_id(0).to(tl.int64)
    tr, tcol = t // TC, t % TC
    i = tl.arange(0, C)[:, None]
    j = tl.arange(0, C)[None, :]
    b = tl.load(B + i * C + j)
    bt = tl.load(B + j * C + i)
    grow, gcol = tr * C + i, tcol * C + j
    inside = (grow < R) & (gcol < CC)
    if INVERSE:
        y = tl.load(X + t * C * C + i * C + j).to(tl.float32)
        out = tl.dot(tl.dot(bt, y, input_precision="ieee"), b, input_precision="ieee")
        tl.store(Y + grow * CC + gcol, out, mask=inside)
    else:
        x = tl.load(X + grow * CC + gcol, mask=inside, other=0.0).to(tl.float32)
        out = tl.dot(tl.dot(b, x, input_precision="ieee"), bt, input_precision="ieee")
        tl.store(Y + t * C * C + i * C + j, out)


def dct_triton(x: torch.Tensor, chunk: int, dims: int = 1) -> torch.Tensor:
    check_args(x.shape, chunk, dims)
    if not triton_ok(chunk):
        return dct_ref(x, chunk, dims)
    b = dct_basis(chunk, x.device)
    xc = x.contiguous()
    if dims == 1:
        n = xc.numel()
        rows = cdiv(n, chunk)
        y = torch.empty(rows, chunk, dtype=torch.float32, device=x.device)
        if rows:
            _dct1_kernel[(cdiv(rows, ROWS_1D),)](xc, b, y, n, C=chunk, ROWS=ROWS_1D, INVERSE=False)
        return y
    r, c = xc.shape
    tr, tc = cdiv(r, chunk), cdiv(c, chunk)
    y = torch.empty(tr * tc, chunk * chunk, dtype=torch.float32, device=x.device)
    if tr * tc:
        _dct2_kernel[(tr * tc,)](xc, b, y, r, c, tc, C=chunk, INVERSE=False)
    return y


def idct_triton(coeffs: torch.Tensor, chunk: int, shape, dims: int = 1) -> torch.Tensor:
    shape = torch.Size(shape)
    check_args(shape, chunk, dims)
    if not triton_ok(chunk):
        return idct_ref(coeffs, chunk, shape, dims)
    b = dct_basis(chunk, coeffs.device)
    cf = coeffs.float().contiguous()
    out = torch.empty(shape, dtype=torch.float32, device=coeffs.device)
    if dims == 1:
        n = shape.numel()
        if n:
            _dct1_kernel[(cdiv(cdiv(n, chunk), ROWS_1D),)](cf, b, out, n, C=chunk, ROWS=ROWS_1D, INVERSE=True)
        return out
    r, c = shape
    tr, tc = cdiv(r, chunk), cdiv(c, chunk)
    if tr * tc:
        _dct2_kernel[(tr * tc,)](cf, b, out, r, c, tc, C=chunk, INVERSE=True)
    return out
