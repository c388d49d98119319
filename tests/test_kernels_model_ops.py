"""Model ops: Triton (under TRITON_INTERPRET=1 on the CPU) against the references, forward and
every gradient, on odd shapes, fp32 and fp16. Kernels are jitted lazily per interpreter mode, so
setting the environment in a fixture works whatever other test modules ran first."""

from __future__ import annotations

import os

# Before anything below can import triton: Triton fixes interpret-or-compile at its import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _kernels_helpers import assert_close, interpreter_subprocess  # noqa: E402

from murmur import kernels  # noqa: E402
from murmur.kernels import glu, linear_xent, rmsnorm, rope  # noqa: E402
from murmur.kernels.dispatch import KernelError, interpreter_ready, use_triton  # noqa: E402

# If another test module imported triton first without the interpreter, this file's interpreter
# tests run (all of them, for real) in a subprocess instead of being skipped.
READY = interpreter_ready()

DTYPES = [torch.float32, torch.float16]


@pytest.fixture
def interp(monkeypatch):
    if not READY:
        pytest.skip("triton was imported without TRITON_INTERPRET: covered by test_in_subprocess")
    monkeypatch.setenv("MURMUR_KERNELS", "triton")


@pytest.mark.skipif(READY, reason="this process runs the interpreter tests itself")
def test_in_subprocess():
    interpreter_subprocess(__file__)


def _grads(out, inputs, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, g)


def _leaf(shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 37), (3, 5, 37), (2, 64), (0, 16)])
def test_rms_norm(interp, shape, dtype):
    x = _leaf(shape, dtype, 1)
    w = _leaf(shape[-1:], torch.float32, 2)
    y = kernels.rms_norm(x, w, 1e-5)
    want = rmsnorm.rms_norm_ref(x, w, 1e-5)
    assert_close(y, want, "rms_norm y")
    if x.numel():
        got_g, want_g = _grads(y, (x, w)), _grads(want, (x, w))
        assert_close(got_g[0], want_g[0], "rms_norm dx")
        assert_close(got_g[1], want_g[1], "rms_norm dweight", dtype=dtype)


@pytest.mark.parametrize("shape", [(5, 37), (40, 300), (1000, 48)])
def test_rms_norm_out_dtype(interp, shape):
    """fp32 in, bf16 out (the autocast case): one rounding of the fp32 result; tiles of several
    rows with a ragged last tile, and (1000 rows) a backward whose programs each walk several
    tiles of their slice, the last slice ragged."""
    x = _leaf(shape, torch.float32, 13)
    w = _leaf(shape[-1:], torch.float32, 14)
    y = kernels.rms_norm(x, w, 1e-5, torch.bfloat16)
    want = rmsnorm.rms_norm_ref(x, w, 1e-5, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_close(y, want, "rms_norm bf16 y")
    got_g, want_g = _grads(y, (x, w)), _grads(want, (x, w))
    assert_close(got_g[0], want_g[0], "rms_norm dx", dtype=torch.bfloat16)
    assert_close(got_g[1], want_g[1], "rms_norm dweight", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 3, 5, 6), (1, 7, 2, 18)])
def test_rotary(interp, shape, dtype):
    b, t, h, d = shape
    x = _leaf(shape, dtype, 3)
    ang = torch.rand(t, d // 2, generator=torch.Generator().manual_seed(4)) * 6.28
    y = kernels.rotary(x, ang.cos(), ang.sin())
    want = rope.rotary_ref(x, ang.cos(), ang.sin())
    assert_close(y, want, "rotary y")
    assert_close(_grads(y, x)[0], _grads(want, x)[0], "rotary dx")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (1027,), (3, 5, 33)])
def test_swiglu(interp, shape, dtype):
    g, u = _leaf(shape, dtype, 5, 3.0), _leaf(shape, dtype, 6)
    y = kernels.swiglu(g, u)
    want = glu.swiglu_ref(g, u)
    assert_close(y, want, "swiglu y")
    got_g, want_g = _grads(y, (g, u)), _grads(want, (g, u))
    assert_close(got_g[0], want_g[0], "swiglu dgate")
    assert_close(got_g[1], want_g[1], "swiglu dup")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d,v,chunk", [(1, 8, 5, 4), (37, 24, 300, 16), (20, 16, 4099, 64)])
def test_linear_cross_entropy(interp, n, d, v, chunk, dtype):
    h = _leaf((n, d), dtype, 7)
    w = _leaf((v, d), dtype, 8, 0.5)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(9))
    if n > 3:
        t[::3] = -100   # ignored targets count neither in the sum nor in the mean
    loss = linear_xent.linear_cross_entropy_triton(h, w, t, chunk=chunk)
    want = linear_xent.linear_cross_entropy_ref(h, w, t)
    assert_close(loss, want, "linear_cross_entropy loss", dtype=dtype)
    got_g = torch.autograd.grad(loss * 1.7, (h, w))
    want_g = torch.autograd.grad(want * 1.7, (h, w))
    assert_close(got_g[0], want_g[0], "linear_cross_entropy dhidden")
    assert_close(got_g[1], want_g[1], "linear_cross_entropy dweight")


def test_linear_cross_entropy_dispatch_and_no_grad(interp):
    h, w = _leaf((9, 8), torch.float32, 10), _leaf((33, 8), torch.float32, 11)
    t = torch.randint(0, 33, (9,), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        loss = kernels.linear_cross_entropy(h, w, t)
    assert_close(loss, linear_xent.linear_cross_entropy_ref(h, w, t), "no-grad loss")
    all_ignored = torch.full((9,), -100)
    assert torch.isnan(kernels.linear_cross_entropy(h, w, all_ignored)).item()


def test_custom_ops_pass_opcheck(interp):
    """Schema, fake (meta) and autograd registrations agree with the real kernels. The training
    ops' fake is their own launcher run on fake tensors (the triton_op contract on a GPU)."""
    x, w = torch.randn(37, 20, requires_grad=True), torch.randn(20, requires_grad=True)
    for code in (-1, 1):   # x's dtype, bf16
        torch.library.opcheck(rmsnorm.rms_norm_fwd.op, (x, w, 1e-5, code))
    rstd = torch.rand(37) + 0.5
    torch.library.opcheck(rmsnorm.rms_norm_bwd.op, (torch.randn(37, 20), x.detach(), w.detach(), rstd))
    q, cs = torch.randn(1, 3, 2, 8, requires_grad=True), torch.rand(3, 4)
    torch.library.opcheck(rope.rotary_op.op, (q, cs.cos(), cs.sin(), False))
    g, u = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    torch.library.opcheck(glu.swiglu_fwd.op, (g, u))
    torch.library.opcheck(glu.swiglu_bwd.op, (torch.randn(40), g.detach(), u.detach()))
    h, wv, t = torch.randn(5, 8, requires_grad=True), torch.randn(17, 8, requires_grad=True), torch.arange(5)
    torch.library.opcheck(linear_xent.linear_xent_op, (h, wv, t, -100, True, 2),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_model_trains_same_with_triton_and_torch(interp, monkeypatch):
    """The tiny model's loss and every parameter gradient agree between the two paths."""
    from murmur.node.model.transformer import build_model, model_config

    cfg = model_config("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=2, hidden_dim=40, seq_len=16)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("MURMUR_KERNELS", impl)
        model = build_model(cfg, seed=3)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert_close(results["triton"][0], results["torch"][0], "tiny model loss")
    for name, g in results["torch"][1].items():
        assert_close(results["triton"][1][name], g, f"tiny model grad {name}")


def test_compile_choice(monkeypatch):
    """MURMUR_COMPILE: auto compiles CUDA inputs only, never inside vmap; bad values are named."""
    from murmur.kernels.dispatch import compile_enabled

    x = torch.zeros(2, 3, dtype=torch.long)
    monkeypatch.delenv("MURMUR_COMPILE", raising=False)
    assert not compile_enabled(x)
    monkeypatch.setenv("MURMUR_COMPILE", "on")
    assert compile_enabled(x)
    assert not torch.func.vmap(lambda r: torch.tensor(compile_enabled(r)))(x).any()
    monkeypatch.setenv("MURMUR_COMPILE", "maybe")
    with pytest.raises(KernelError, match=r"MURMUR_COMPILE='maybe' is not one of auto\|on\|off"):
        compile_enabled(x)


def test_dispatch_choices(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv("MURMUR_KERNELS", raising=False)
    assert not use_triton(x)            # CPU tensors: reference
    monkeypatch.setenv("MURMUR_KERNELS", "torch")
    assert not use_triton(x)
    monkeypatch.setenv("MURMUR_KERNELS", "cuda")
    with pytest.raises(KernelError, match="MURMUR_KERNELS='cuda' is not one of"):
        use_triton(x)
    monkeypatch.setenv("MURMUR_KERNELS", "linear_cross_entropy,rms_norm")   # a list of ops
    assert not use_triton(x, op="rms_norm")   # still only for CUDA tensors
    monkeypatch.setenv("MURMUR_KERNELS", "rms_norm,softmax")
    with pytest.raises(KernelError, match="nor a comma-separated list of rms_norm"):
        use_triton(x, op="rms_norm")
    monkeypatch.setenv("MURMUR_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelError, match="needs TRITON_INTERPRET=1, set before triton"):
        kernels.rms_norm(x, x, 1e-5)


def test_the_simulators_stacked_replicas_take_the_fused_head_one_replica_at_a_time(interp, byte_dataset,
                                                                                    monkeypatch):
    """The fused linear + cross-entropy has no batching rule, so where it runs the stacked engine
    vmaps the model up to its final norm and calls the kernel per replica. Losses and every
    replica's gradients must equal the vmapped reference's (MURMUR_KERNELS=torch)."""
    from murmur.node.model.data import Dataset
    from murmur.node.sim.replicas import worker_loaders
    from murmur.node.sim.stacked import StackedReplicas
    from murmur.protocol.runconfig import config_from_dict

    cfg = config_from_dict({
        "seed": 3, "model": {"preset": "tiny", "n_layers": 1, "seq_len": 16},
        "data": {"path": str(byte_dataset.root)}, "train": {"batch_size": 2, "steps": 4},
        "sync": {"algorithm": "diloco", "inner_steps": 2, "overlap_steps": 0, "codec": "fp32"},
    })
    ds = Dataset.open(byte_dataset.root)
    calls = []
    fused_op = linear_xent.linear_cross_entropy_triton
    monkeypatch.setattr(linear_xent, "linear_cross_entropy_triton", lambda *a: calls.append(1) or fused_op(*a))
    reps = StackedReplicas(cfg, 3, torch.device("cpu"), worker_loaders(ds, 2, 16), ds.vocab_size, ["a", "b", "c"])
    try:
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, ds.vocab_size, (3, 2, 16), generator=gen) for _ in range(2))
        params = [reps.stacked[n] for n in reps.names]
        fused = reps._loss(x, y)
        fused_grads = torch.autograd.grad(fused.sum(), params)
        assert len(calls) == 3  # the kernel ran, once per replica
        os.environ["MURMUR_KERNELS"] = "torch"  # the interp fixture's monkeypatch restores it
        want = reps._loss(x, y)
        want_grads = torch.autograd.grad(want.sum(), params)
    finally:
        reps.close()
    assert fused.shape == (3,) and len(set(fused.tolist())) == 3  # three replicas, three batches
    assert_close(fused, want, "stacked losses")
    for name, got, ref in zip(reps.names, fused_grads, want_grads, strict=True):
        assert_close(got, ref, f"d {name}")
