"""Single-node training throughput: tokens/s and model FLOPs utilization of a preset.

Each implementation runs in its own subprocess, so the kernel choice (MURMUR_KERNELS) and
torch.compile state never leak between rows:
  eager    pure-torch reference ops, no compile (the baseline)
  compile  pure-torch reference ops under torch.compile
  fused    murmur's Triton kernels (MURMUR_KERNELS=triton), no compile
  fused+compile  both

    python benchmarks/train_throughput.py --preset base --impls eager,compile,fused
writes benchmarks/results/train_throughput.json (rows merged by (preset, impl, batch)).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"
# Dense bf16 peak of the device, for MFU (the H200 datasheet's 989 TFLOP/s; ~790 measured, ALGORITHMS.md).
PEAK_TFLOPS = {"NVIDIA H200": 989.0}


def measure(preset: str, impl: str, batch: int, steps: int, warmup: int, data: str | None) -> dict:
    import torch

    from murmur.node.model.transformer import Transformer, model_config
    from murmur.node.train.trainer import autocast
    from murmur.optim.inner import make_inner_optimizer as make_optimizer
    from murmur.protocol.runconfig import OptimSection

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_config(preset)
    model = Transformer(cfg, seed=0).to(device)
    opt = make_optimizer(model, OptimSection())
    fwd = torch.compile(model) if "compile" in impl else model
    if data:
        from murmur.node.model.data import BatchLoader, Dataset

        loader = BatchLoader(Dataset.open(data), list(range(Dataset.open(data).num_shards)), batch, cfg.seq_len)
        batches = [next(loader) for _ in range(8)]
    else:
        gen = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(8):
            t = torch.randint(0, min(cfg.vocab_size, 50257), (batch, cfg.seq_len + 1), generator=gen)
            batches.append((t[:, :-1], t[:, 1:]))
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    def step(i: int) -> float:
        x, y = batches[i % len(batches)]
        with autocast(device):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_compile = time.perf_counter()
    for i in range(warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t_compile = time.perf_counter() - t_compile
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    final_loss = float(loss)  # synchronizes
    seconds = time.perf_counter() - t0
    tokens_per_s = steps * batch * cfg.seq_len / seconds
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = PEAK_TFLOPS.get(name)
    return {
        "preset": preset,
        "params_m": round(cfg.num_params() / 1e6, 1),
        "impl": impl,
        "batch": batch,
        "seq_len": cfg.seq_len,
        "dtype": "bf16" if device.type == "cuda" else "fp32",
        "steps": steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "ms_per_step": round(1000 * seconds / steps, 2),
        "mfu": round(cfg.flops_per_token() * tokens_per_s / (peak * 1e12), 4) if peak else None,
        "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.type == "cuda" else None,
        "warmup_s": round(t_compile, 1),
        "final_loss": round(final_loss, 4),
        "device": name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--impls", default="eager,compile")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--data", help="a prepared dataset folder (default: random tokens)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one impl, print JSON
    args = ap.parse_args()

    if args.one:
        print("ROW " + json.dumps(measure(args.preset, args.one, args.batch, args.steps, args.warmup, args.data)))
        return

    rows = []
    for impl in args.impls.split(","):
        env = dict(os.environ, MURMUR_KERNELS="triton" if impl.startswith("fused") else "torch")
        cmd = [sys.executable, __file__, "--one", impl, "--preset", args.preset, "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--data", args.data] if args.data else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")), None)
        if proc.returncode or not line:
            print(f"{impl}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            rows.append({"preset": args.preset, "impl": impl, "batch": args.batch, "error": proc.stderr[-500:]})
            continue
        row = json.loads(line[4:])
        rows.append(row)
        print(f"{row['preset']:6s} {impl:14s} {row['tokens_per_s']:>12,.0f} tok/s  mfu {row['mfu']}  "
              f"{row['ms_per_step']} ms/step  peak {row['peak_mem_mb']} MB", flush=True)

    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {"rows": []}
    keep = [r for r in old.get("rows", []) if (r.get("preset"), r.get("impl"), r.get("batch")) not in
            {(r2["preset"], r2["impl"], r2["batch"]) for r2 in rows}]
    result = {
        "benchmark": "train_throughput",
        "device": next((r["device"] for r in rows if "device" in r), "unknown"),
        "date": dt.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        "notes": "tokens/s of AdamW training steps (bf16 autocast on GPU); mfu against the dense bf16 "
                 "datasheet peak; eager = pure-torch reference ops",
        "rows": keep + rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
