"""Compression ops: Triton (TRITON_INTERPRET=1 on the CPU) against the references, the wire
layouts by hand, and the codec properties on both implementations: error bounds, unbiased
stochastic rounding, and the error-feedback identity."""

from __future__ import annotations

import math
import os

# Before anything below can import triton: Triton fixes interpret-or-compile at its import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _kernels_helpers import assert_close, interpreter_subprocess  # noqa: E402

from murmur import kernels  # noqa: E402
from murmur.kernels import dct, quant, sign, topk  # noqa: E402
from murmur.kernels.dispatch import KernelError, interpreter_ready  # noqa: E402

READY = interpreter_ready()


@pytest.mark.skipif(READY, reason="this process runs the interpreter tests itself")
def test_in_subprocess():
    interpreter_subprocess(__file__)


@pytest.fixture
def interp(monkeypatch):
    if not READY:
        pytest.skip("triton was imported without TRITON_INTERPRET: covered by test_in_subprocess")
    monkeypatch.setenv("MURMUR_KERNELS", "triton")


@pytest.fixture(params=["torch", "triton"])
def impl(request, monkeypatch):
    """Run a property test on the reference and on the Triton kernels."""
    if request.param == "triton" and not READY:
        pytest.skip("triton was imported without TRITON_INTERPRET: covered by test_in_subprocess")
    monkeypatch.setenv("MURMUR_KERNELS", request.param)
    return request.param


def _randn(n, seed, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- quantization


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(0, 8), (1, 2), (7, 4), (129, 32), (1000, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_matches_reference(interp, bits, n, block, dtype):
    x = _randn(n, 1, dtype)
    r_ref, r_tri = _randn(n, 2) * 0.05, None
    r_tri = r_ref.clone()
    q_ref, s_ref, e_ref = quant.quantize_ref(x, bits, block, residual=r_ref)
    q, s, e = kernels.quantize_blockwise(x, bits, block, residual=r_tri)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape == (n if bits == 8 else math.ceil(n / 2),)
    assert torch.equal(q, q_ref), f"codes differ at {(q != q_ref).nonzero().flatten()[:10].tolist()}"
    assert_close(s, s_ref, "scales")
    assert e is r_tri and e_ref is r_ref            # the residual is updated in place
    assert_close(e, e_ref, "new residual")
    out = torch.ones(n)
    kernels.dequantize_blockwise(q, s, bits, block, (n,), out=out, accumulate=True)
    assert_close(out, quant.dequantize_ref(q_ref, s_ref, bits, block, (n,)) + 1, "dequantize-accumulate")


def test_int4_wire_layout_by_hand(impl):
    x = torch.tensor([1.0, -1.0, 0.5, 0.0, 3.0])
    q, s, _ = kernels.quantize_blockwise(x, 4, 2)
    # block 0: amax 1 -> codes 7, -7 -> nibbles 15, 1; block 1: 0.5 -> 7, 0 -> 15, 8;
    # block 2 (short): 3 -> 7, padding nibble 8.
    assert q.tolist() == [15 | 1 << 4, 15 | 8 << 4, 15 | 8 << 4]
    assert s.tolist() == pytest.approx([1 / 7, 0.5 / 7, 3 / 7])
    q8, s8, _ = kernels.quantize_blockwise(x, 8, 4)
    assert q8.tolist() == [127, -127, 64, 0, 127] and q8.dtype == torch.int8


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True])
def test_dequantize_error_within_bound(impl, bits, stochastic):
    x = _randn(999, 3) * torch.linspace(0.01, 100, 999)   # outliers in some blocks only
    block = 64
    q, s, _ = kernels.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=5)
    err = (kernels.dequantize_blockwise(q, s, bits, block, x.shape) - x).abs()
    step = s.repeat_interleave(block)[: x.numel()]
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-5) + 1e-6
    assert (err <= bound).all(), f"worst error {float((err / step).max()):.3f} steps"


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(impl, bits):
    # 256 values sitting 0.3 of a step above a code, quantized 400 times with independent draws
    # (one call: 400 copies, one block each). Round-to-nearest is off by 0.3 steps every time;
    # stochastic rounding must average out to within 5 standard errors per element.
    qmax = quant.QMAX[bits]
    base = torch.randint(-qmax + 1, qmax - 1, (256,), generator=torch.Generator().manual_seed(0)).float()
    x = (base + 0.3) / qmax
    x[0] = 1.0                                         # pins the block's absmax: step = 1/qmax
    reps = 400
    q, s, _ = kernels.quantize_blockwise(x.repeat(reps), bits, 256, stochastic=True, seed=11)
    mean = kernels.dequantize_blockwise(q, s, bits, 256, (reps * 256,)).view(reps, 256).mean(0)
    step = 1.0 / qmax
    std_err = 0.5 * step / math.sqrt(reps)
    assert (mean - x).abs().max() < 5 * std_err
    qd, sd, _ = kernels.quantize_blockwise(x, bits, 256)
    det_bias = (kernels.dequantize_blockwise(qd, sd, bits, 256, x.shape) - x)[1:].mean()
    assert det_bias.abs() > 0.25 * step                # the test can tell a biased codec


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True])
def test_error_feedback_conserves_the_sum(impl, bits, stochastic):
    n, block, rounds = 301, 32, 6
    residual = torch.zeros(n)
    sent, total = torch.zeros(n), torch.zeros(n)
    for r in range(rounds):
        x = _randn(n, 100 + r) * (10.0 ** (r % 3 - 1))
        total += x
        q, s, e = kernels.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=r, residual=residual)
        assert e is residual
        kernels.dequantize_blockwise(q, s, bits, block, (n,), out=sent, accumulate=True)
    assert_close(sent + residual, total, "sent + final residual vs sum of inputs")


def test_stochastic_codes_repeat_with_the_seed(impl):
    x = _randn(500, 4)
    a = kernels.quantize_blockwise(x, 4, 50, stochastic=True, seed=9)[0]
    b = kernels.quantize_blockwise(x, 4, 50, stochastic=True, seed=9)[0]
    c = kernels.quantize_blockwise(x, 4, 50, stochastic=True, seed=10)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("n,k,chunk", [(0, 1, 4), (7, 7, 8), (70, 8, 64), (100, 3, 48), (1000, 5, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_topk_matches_reference(interp, n, k, chunk, dtype):
    x = _randn(n, 6, dtype)
    if n > 10:
        x[3] = x[4] = -x[5]                            # ties go to the lower index
    v, i = kernels.topk_chunked(x, k, chunk)
    v_ref, i_ref = topk.topk_ref(x, k, chunk)
    assert i.dtype == torch.int16 and torch.equal(i, i_ref) and torch.equal(v, v_ref)
    out = torch.full((n,), 2.0, dtype=dtype)
    kernels.scatter_topk(v, i, chunk, (n,), out=out, accumulate=True)
    assert torch.equal(out, topk.scatter_ref(v_ref, i_ref, chunk, (n,)) + 2)


def test_topk_keeps_largest_and_scatter_restores(impl):
    x = _randn(203, 7)
    v, i = kernels.topk_chunked(x.view(7, 29), 64, 64)      # k == chunk: everything, short last chunk
    assert torch.equal(kernels.scatter_topk(v, i, 64, (7, 29)), x.view(7, 29))
    v, i = kernels.topk_chunked(x, 3, 50)
    for c in range(5):
        chunk = x[c * 50:(c + 1) * 50]
        assert sorted(i[c].tolist()) == sorted(chunk.abs().topk(3).indices.tolist())
        assert (v[c].abs().diff() <= 0).all()                # decreasing magnitude
    assert topk.index_dtype(40000) == torch.int32 and topk.index_dtype(32768) == torch.int16


# ---------------------------------------------------------------- DCT


def test_dct_basis_is_the_dct_ii():
    c = 8
    b = kernels.dct_basis(c).double()
    x = torch.randn(c, dtype=torch.float64)
    direct = torch.tensor([sum(x[i] * math.cos(math.pi * (2 * i + 1) * k / (2 * c)) for i in range(c))
                           * math.sqrt((1 if k == 0 else 2) / c) for k in range(c)])
    assert torch.allclose(b @ x, direct, atol=1e-6)
    assert torch.allclose(b @ b.t(), torch.eye(c, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("shape,chunk,dims", [((0,), 16, 1), ((5,), 16, 1), ((1000,), 16, 1),
                                              ((100,), 64, 1), ((70, 33), 16, 2), ((64, 64), 64, 2)])
def test_dct_matches_reference(interp, shape, chunk, dims):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(8))
    y = kernels.dct_chunked(x, chunk, dims)
    assert_close(y, dct.dct_ref(x, chunk, dims), "dct")
    assert_close(kernels.idct_chunked(y, chunk, shape, dims), x, "idct(dct(x))")


def test_dct_roundtrip_and_parseval(impl):
    x = torch.randn(40, 50, generator=torch.Generator().manual_seed(9))
    for dims in (1, 2):
        y = kernels.dct_chunked(x, 16, dims)
        assert y.shape == ((125, 16) if dims == 1 else (12, 256))
        assert torch.allclose(y.pow(2).sum(), x.pow(2).sum(), rtol=1e-5)
        assert_close(kernels.idct_chunked(y, 16, x.shape, dims), x, f"roundtrip dims={dims}")
    assert_close(kernels.idct_chunked(kernels.dct_chunked(x, 10), 10, x.shape), x, "chunk 10 (reference path)")


# ---------------------------------------------------------------- sign


@pytest.mark.parametrize("n,block", [(0, 8), (7, 8), (130, 32), (1000, 64), (4100, 4096)])
def test_sign_matches_reference(interp, n, block):
    x = _randn(n, 10)
    bits, scales = kernels.sign_pack(x, block)
    bits_ref, scales_ref = sign.sign_pack_ref(x, block)
    assert torch.equal(bits, bits_ref) and bits.shape == (math.ceil(n / 8),)
    assert_close(scales, scales_ref, "sign scales")
    out = torch.ones(n)
    kernels.sign_unpack(bits, scales, block, (n,), out=out, accumulate=True)
    assert_close(out, sign.sign_unpack_ref(bits_ref, scales_ref, block, (n,)) + 1, "sign unpack-accumulate")


def test_sign_layout_by_hand(impl):
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, -1.0, 3.0, -1.0, 1.0, -4.0])
    bits, scales = kernels.sign_pack(x, 8)
    assert bits.tolist() == [0b10101101, 0]
    assert scales.tolist() == pytest.approx([9 / 8, 4.0])
    assert kernels.sign_unpack(bits, scales, 8, (9,)).tolist() == pytest.approx(
        [9 / 8, -9 / 8, 9 / 8, 9 / 8, -9 / 8, 9 / 8, -9 / 8, 9 / 8, -4.0])


# ---------------------------------------------------------------- bad input


def test_bad_arguments_are_clear_errors(impl):
    x = torch.zeros(10)
    with pytest.raises(KernelError, match="bits must be 8 or 4"):
        kernels.quantize_blockwise(x, 3, 8)
    with pytest.raises(KernelError, match="even for int4"):
        kernels.quantize_blockwise(x, 4, 5)
    with pytest.raises(KernelError, match="residual shape"):
        kernels.quantize_blockwise(x, 8, 8, residual=torch.zeros(3))
    with pytest.raises(KernelError, match="1 <= k <= chunk"):
        kernels.topk_chunked(x, 9, 8)
    with pytest.raises(KernelError, match="multiple of 8"):
        kernels.sign_pack(x, 12)
    with pytest.raises(KernelError, match="needs a 2-D tensor"):
        kernels.dct_chunked(x, 16, dims=2)
