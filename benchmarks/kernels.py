"""Kernel benchmark: every op as eager (the pure-torch reference), torch.compile of the reference,
and the Triton kernel; plus the device's copy bandwidth, so that memory-bound ops read as a
fraction of it, and a same-seed loss-curve check of the model with fused vs reference ops.

    source benchmarks/gpu_env.sh && python3 benchmarks/kernels.py            # all ops, on a GPU
    python3 benchmarks/kernels.py --curve-steps 100 --data data/shakespeare-gpt2
    TRITON_INTERPRET=1 python benchmarks/kernels.py --smoke --impls eager,triton   # CPU code check

Writes benchmarks/results/kernels.json: rows {op, shape, dtype, impl, ms, gbps, frac_copy,
peak_mem_mb}, the copy bandwidth, a summary against the issue's targets and the loss curves.
gbps counts the bytes an op must move at least (inputs read once, outputs written once).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
MODEL_OPS = ("rms_norm", "rotary", "swiglu")
SLEEP_CYCLES = 200_000_000   # ~0.1 s of GPU sleep: longer than it takes the host to queue `reps` calls


class Timer:
    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object]) -> float:
        """GPU time per call: `reps` calls queued behind a GPU sleep, so the host's launch and
        Python overhead (custom-op dispatch included) overlaps the sleep instead of the timing."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        if self.device.type != "cuda":
            return self.wall_ms(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(self.reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.reps

    def wall_ms(self, fn: Callable[[], object]) -> float:
        """Median host time of one synchronized call: what a latency-bound caller sees."""
        times = []
        for _ in range(self.reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    def peak_mb(self, fn: Callable[[], object]) -> float | None:
        """Peak memory one call allocates beyond what was live before it."""
        if self.device.type != "cuda":
            return None
        self.sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        self.sync()
        return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def copy_bandwidth(timer: Timer, numel: int) -> float:
    src = torch.empty(numel, dtype=torch.float32, device=timer.device).uniform_()
    dst = torch.empty_like(src)
    ms = timer.ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6   # read + write, GB/s


def _fwd_bwd(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    """One forward and backward of fn(*inputs); the input grads are dropped after each call."""
    leaves = [t for t in inputs if t.requires_grad]

    def run() -> None:
        y = fn(*inputs)
        y.backward(torch.ones_like(y) if y.dim() else None)
        for t in leaves:
            t.grad = None
    return run


def cases(device: torch.device, smoke: bool) -> list[dict]:
    """(op, shape, dtype, bytes moved, {impl: fn}) for each benchmarked configuration."""
    from murmur.kernels import dct, glu, linear_xent, quant, rmsnorm, rope, sign, topk

    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok, dim, hid, heads, hd, vocab = (16384, 768, 2048, 12, 64, 50257) if not smoke else (64, 32, 48, 2, 16, 500)
    big = 1 << 26 if not smoke else 1 << 12
    xent_n = 8192 if not smoke else 32
    out: list[dict] = []

    def leaf(shape, dtype=bf16, scale=1.0):
        return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()

    # Model ops, forward and forward+backward (bf16 activations, as under autocast).
    x, w = leaf((tok, dim)), leaf((dim,), torch.float32)
    es = x.element_size()
    for mode, fn in (("fwd", lambda f: (lambda: f(x, w, 1e-5))),
                     ("fwd+bwd", lambda f: _fwd_bwd(lambda a, b: f(a, b, 1e-5).sum(), [x, w]))):
        out.append(dict(op=f"rms_norm {mode}", shape=[tok, dim], dtype=str(bf16)[6:],
                        bytes=(2 if mode == "fwd" else 5) * x.numel() * es,
                        impls={"eager": fn(rmsnorm.rms_norm_ref), "triton": fn(rmsnorm.rms_norm_triton)},
                        compile_src=(rmsnorm.rms_norm_ref, fn)))
    q = leaf((tok // 1024 if not smoke else 2, 1024 if not smoke else 32, heads, hd))
    ang = torch.rand(q.shape[1], hd // 2, device=device)
    cos, sin = ang.cos(), ang.sin()
    for mode, fn in (("fwd", lambda f: (lambda: f(q, cos, sin))),
                     ("fwd+bwd", lambda f: _fwd_bwd(lambda a: f(a, cos, sin).sum(), [q]))):
        out.append(dict(op=f"rotary {mode}", shape=list(q.shape), dtype=str(bf16)[6:],
                        bytes=(2 if mode == "fwd" else 4) * q.numel() * es,
                        impls={"eager": fn(rope.rotary_ref), "triton": fn(rope.rotary_triton)},
                        compile_src=(rope.rotary_ref, fn)))
    g, u = leaf((tok, hid)), leaf((tok, hid))
    for mode, fn in (("fwd", lambda f: (lambda: f(g, u))),
                     ("fwd+bwd", lambda f: _fwd_bwd(lambda a, b: f(a, b).sum(), [g, u]))):
        out.append(dict(op=f"swiglu {mode}", shape=[tok, hid], dtype=str(bf16)[6:],
                        bytes=(3 if mode == "fwd" else 8) * g.numel() * es,
                        impls={"eager": fn(glu.swiglu_ref), "triton": fn(glu.swiglu_triton)},
                        compile_src=(glu.swiglu_ref, fn)))
    h, wv = leaf((xent_n, dim)), leaf((vocab, dim), scale=0.02)
    t = torch.randint(0, vocab, (xent_n,), device=device)
    fn = lambda f: _fwd_bwd(lambda a, b: f(a, b, t), [h, wv])
    out.append(dict(op="linear_cross_entropy fwd+bwd", shape=[xent_n, dim, vocab], dtype=str(bf16)[6:],
                    bytes=None, impls={"eager": fn(linear_xent.linear_cross_entropy_ref),
                                       "triton": fn(linear_xent.linear_cross_entropy_triton)},
                    compile_src=(linear_xent.linear_cross_entropy_ref, fn)))

    # Compression ops on fp32 pseudo-gradients.
    v = torch.randn(big, device=device)
    for bits in (8, 4):
        res = torch.zeros(big, device=device)
        qb = big if bits == 8 else big // 2
        fn = lambda f, bits=bits, res=res: (lambda: f(v, bits, 64, False, None, res, None))
        out.append(dict(op=f"quantize int{bits} +error feedback", shape=[big], dtype="float32", block=64,
                        bytes=12 * big + qb + big // 16,
                        impls={"eager": fn(quant.quantize_ref), "triton": fn(quant.quantize_triton)},
                        compile_src=(quant.quantize_ref, fn)))
        codes, scales, _ = quant.quantize_triton(v, bits, 64) if device.type == "cuda" else \
            quant.quantize_ref(v, bits, 64)
        acc = torch.zeros(big, device=device)
        fn = lambda f, c=codes, s=scales, bits=bits, acc=acc: (lambda: f(c, s, bits, 64, (big,), acc, True))
        out.append(dict(op=f"dequantize-accumulate int{bits}", shape=[big], dtype="float32", block=64,
                        bytes=8 * big + qb + big // 16,
                        impls={"eager": fn(quant.dequantize_ref), "triton": fn(quant.dequantize_triton)},
                        compile_src=(quant.dequantize_ref, fn)))
    kk, chunk = (64, 4096) if not smoke else (4, 64)
    fn = lambda f: (lambda: f(v, kk, chunk))
    out.append(dict(op=f"topk k={kk} chunk={chunk}", shape=[big], dtype="float32",
                    bytes=4 * big + 6 * kk * big // chunk,
                    impls={"eager": fn(topk.topk_ref), "triton": fn(topk.topk_triton)},
                    compile_src=(topk.topk_ref, fn)))
    vals, idx = topk.topk_ref(v, kk, chunk)
    dense = torch.zeros(big, device=device)
    fn = lambda f: (lambda: f(vals, idx, chunk, (big,), dense, True))
    out.append(dict(op=f"scatter_topk-accumulate k={kk} chunk={chunk}", shape=[big], dtype="float32",
                    bytes=6 * kk * big // chunk + 8 * kk * big // chunk,
                    impls={"eager": fn(topk.scatter_ref), "triton": fn(topk.scatter_triton)},
                    compile_src=(topk.scatter_ref, fn)))
    side = 8192 if not smoke else 64
    m2 = torch.randn(side, side, device=device)
    c = 64 if not smoke else 16
    for dims, src in ((1, v), (2, m2)):
        fn = lambda f, dims=dims, src=src: (lambda: f(src, c, dims))
        out.append(dict(op=f"dct chunk={c} dims={dims}", shape=list(src.shape), dtype="float32",
                        bytes=8 * src.numel(), impls={"eager": fn(dct.dct_ref), "triton": fn(dct.dct_triton)},
                        compile_src=(dct.dct_ref, fn)))
        coeffs = dct.dct_ref(src, c, dims)
        fn = lambda f, dims=dims, src=src, co=coeffs: (lambda: f(co, c, src.shape, dims))
        out.append(dict(op=f"idct chunk={c} dims={dims}", shape=list(src.shape), dtype="float32",
                        bytes=8 * src.numel(), impls={"eager": fn(dct.idct_ref), "triton": fn(dct.idct_triton)},
                        compile_src=(dct.idct_ref, fn)))
    fn = lambda f: (lambda: f(v, 256))
    out.append(dict(op="sign_pack block=256", shape=[big], dtype="float32", bytes=4 * big + big // 8 + big // 64,
                    impls={"eager": fn(sign.sign_pack_ref), "triton": fn(sign.sign_pack_triton)},
                    compile_src=(sign.sign_pack_ref, fn)))
    bits_, sc = sign.sign_pack_ref(v, 256)
    fn = lambda f: (lambda: f(bits_, sc, 256, (big,), dense, True))
    out.append(dict(op="sign_unpack-accumulate block=256", shape=[big], dtype="float32",
                    bytes=8 * big + big // 8 + big // 64,
                    impls={"eager": fn(sign.sign_unpack_ref), "triton": fn(sign.sign_unpack_triton)},
                    compile_src=(sign.sign_unpack_ref, fn)))
    return out


def run_ops(timer: Timer, impls: list[str], copy_gbps: float, smoke: bool, compile_ops: str) -> list[dict]:
    rows = []
    for case in cases(timer.device, smoke):
        fns = dict(case["impls"])
        compiled = compile_ops == "all" or case["op"].startswith(tuple(compile_ops.split(",")))
        if "compile" in impls and compiled:
            ref, wrap = case["compile_src"]
            fns["compile"] = wrap(torch.compile(ref, dynamic=False))
        for impl in (i for i in impls if i in fns):
            row = {"op": case["op"], "shape": case["shape"], "dtype": case["dtype"], "impl": impl}
            try:
                ms = timer.ms(fns[impl])
                row.update(ms=round(ms, 4), ms_wall=round(timer.wall_ms(fns[impl]), 4),
                           peak_mem_mb=timer.peak_mb(fns[impl]))
                if case["bytes"]:
                    row["gbps"] = round(case["bytes"] / ms / 1e6, 1)
                    row["frac_copy"] = round(row["gbps"] / copy_gbps, 3)
            except Exception as e:  # a compile failure is a result too: record it and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch._dynamo.reset()
    return rows


def summarize(rows: list[dict]) -> dict:
    """Each target of the issue, met or not, by how much."""
    by = {(r["op"], r["impl"]): r for r in rows if "ms" in r}
    out: dict[str, dict] = {}
    for op in sorted({r["op"] for r in rows}):
        tri, eag, com = by.get((op, "triton")), by.get((op, "eager")), by.get((op, "compile"))
        if not tri:
            continue
        s: dict[str, object] = {}
        if eag:
            s["speedup_vs_eager"] = round(eag["ms"] / tri["ms"], 2)
        if com:
            s["speedup_vs_compile"] = round(com["ms"] / tri["ms"], 2)
        if "frac_copy" in tri:
            s["frac_copy"] = tri["frac_copy"]
        if op.split()[0] in MODEL_OPS:
            s["target"] = ">= 1.5x eager and >= 1.0x compile"
            s["met"] = s.get("speedup_vs_eager", 0) >= 1.5 and s.get("speedup_vs_compile", 1) >= 1.0
        elif op.startswith(("quantize", "dequantize")):
            s["target"] = ">= 0.70 of copy bandwidth"
            s["met"] = tri.get("frac_copy", 0) >= 0.70
        elif op.startswith("linear_cross_entropy") and eag and eag.get("peak_mem_mb"):
            s["peak_mem_ratio_eager_over_fused"] = round(eag["peak_mem_mb"] / max(tri["peak_mem_mb"], 1e-9), 2)
            s["target"] = ">= 3x lower peak memory than eager"
            s["met"] = s["peak_mem_ratio_eager_over_fused"] >= 3
        out[op] = s
    return out


def loss_curves(device: torch.device, preset: str, steps: int, batch: int, data: str | None) -> dict:
    """Same seed, same batches, same optimizer: the model with the reference ops, then fused."""
    from murmur.node.model.transformer import build_model, model_config
    from murmur.node.train.step import autocast
    from murmur.optim.inner import make_inner_optimizer as make_optimizer
    from murmur.protocol.runconfig import OptimSection

    cfg = model_config(preset)
    if data and Path(data).exists():
        from murmur.node.model.data import BatchLoader, Dataset

        ds = Dataset.open(data)
        loader = BatchLoader(ds, list(range(ds.num_shards)), batch, cfg.seq_len)
        batches = [next(loader) for _ in range(steps)]
        source = data
    else:
        gen = torch.Generator().manual_seed(0)
        toks = torch.randint(0, min(1000, cfg.vocab_size), (steps, batch, cfg.seq_len + 1), generator=gen)
        batches = [(b[:, :-1], b[:, 1:]) for b in toks]
        source = "random tokens below 1000"
    curves = {}
    for impl in ("torch", "triton"):
        os.environ["MURMUR_KERNELS"] = impl
        torch.manual_seed(0)
        model = build_model(cfg, seed=0, device=device)
        opt = make_optimizer(model, OptimSection(warmup_steps=10, lr=1e-3))
        losses = []
        t0 = time.perf_counter()
        for x, y in batches:
            with autocast(device):
                loss = model(x.to(device), y.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(float(loss.detach()), 4))
        curves[impl] = {"losses": losses, "seconds": round(time.perf_counter() - t0, 1)}
        del model, opt
    diffs = [abs(a - b) for a, b in zip(curves["torch"]["losses"], curves["triton"]["losses"], strict=True)]
    tail = max(1, steps // 10)
    return {"preset": preset, "batch": batch, "steps": steps, "data": source,
            "max_abs_diff": round(max(diffs), 4),
            "mean_abs_diff_last_10pct": round(sum(diffs[-tail:]) / tail, 4),
            "final_loss": {k: v["losses"][-1] for k, v in curves.items()},
            "first_loss": {k: v["losses"][0] for k, v in curves.items()},
            "curves": curves}


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="eager,compile,triton")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile-ops", default="all",
                    help="'all' or comma-separated op-name prefixes to also time under torch.compile")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, not the speed")
    ap.add_argument("--no-ops", action="store_true", help="skip the op table (keep earlier rows)")
    ap.add_argument("--curve-steps", type=int, default=0, help="also compare loss curves for N steps")
    ap.add_argument("--curve-preset", default="medium")
    ap.add_argument("--curve-batch", type=int, default=8)
    ap.add_argument("--data", help="prepared dataset for the loss curves (default: random tokens)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(device, args.reps, args.warmup)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() and args.no_ops else {}
    result.update(benchmark="kernels", device=name, date=dt.date.today().isoformat(),
                  command="python3 " + " ".join(sys.argv), torch=torch.__version__,
                  commit=os.environ.get("MURMUR_COMMIT") or _git_commit())
    if not args.no_ops:
        import triton

        copy = copy_bandwidth(timer, 1 << 28 if not args.smoke else 1 << 16)
        print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
        rows = run_ops(timer, args.impls.split(","), copy, args.smoke, args.compile_ops)
        result.update(triton=triton.__version__, copy_gbps=round(copy, 1), rows=rows, summary=summarize(rows),
                      notes="ms: GPU time per call (CUDA events around `reps` calls queued behind a GPU sleep, "
                            "so host overhead is excluded); ms_wall: median synchronized host time of one "
                            "call (includes Python and launch overhead); gbps: minimum bytes moved / ms; frac_copy: "
                            "gbps / measured device-to-device copy bandwidth (read+write); peak_mem_mb: "
                            "allocation peak of one call beyond the live inputs; model ops in bf16, "
                            "codecs on fp32 pseudo-gradients; compile rows for ops matching "
                            f"--compile-ops {args.compile_ops!r}")
    if args.curve_steps:
        result["loss_curve"] = loss_curves(device, args.curve_preset, args.curve_steps, args.curve_batch, args.data)
        lc = result["loss_curve"]
        print(f"loss curve: max |diff| {lc['max_abs_diff']}, final {lc['final_loss']}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
