"""Single-node training throughput: tokens/s, model FLOPs utilization and peak memory of a preset.

Each implementation runs in its own subprocess, so the kernel choice (MURMUR_KERNELS), the compile
choice (MURMUR_COMPILE) and torch.compile state never leak between rows:
  eager          pure-torch reference ops, no compile (the baseline)
  compile        pure-torch reference ops, the whole model under torch.compile
  fused          every op murmur's Triton kernel (MURMUR_KERNELS=triton), no compile
  fused+compile  every op Triton, the whole model under torch.compile (Inductor traces the
                 triton_ops and fuses the code between them)
  compile+xent   the references under torch.compile, but the fused linear + cross-entropy
                 (MURMUR_KERNELS=linear_cross_entropy)
  default        nothing forced: what `murmur train` / `node run --device cuda` / `sim` run
                 (the model compiles its forward itself, Triton only where it beats Inductor,
                 and murmur's AdamW: fused on a GPU)
Every row but default steps torch.optim.AdamW as torch makes it by default (foreach on a GPU), so
"compile" is what a user gets from torch.compile alone; compile+fused_adamw is compile with
murmur's AdamW, to tell the optimizer's share of default's lead from the kernels'.

    source benchmarks/gpu_env.sh && python3 benchmarks/train_throughput.py --preset base \\
        --impls eager,compile,fused,fused+compile,default --repeats 2
writes benchmarks/results/train_throughput.json (rows merged by (preset, impl, batch)). Each row
gives the median of --repeats runs (fresh processes) and their spread; within a run, the step
times from CUDA events between steps (their min/median/max show clock or allocator drift) and the
host's time to queue one step (near the step time: the run is host-bound). --max-batch also
finds the largest batch that fits (predicted from peak memory at two batches, then bisected; one
process per try) and measures a row at it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"
# Dense bf16 matrix rate measured on this workplace's H200 (8192^3 bf16 products, random data);
# the datasheet's 989 TFLOP/s is kept beside it in the JSON.
MEASURED_TFLOPS = {"NVIDIA H200": 790.0}
DATASHEET_TFLOPS = {"NVIDIA H200": 989.0}
IMPLS = ("eager", "compile", "fused", "fused+compile", "compile+xent", "compile+fused_adamw", "default")


def impl_env(impl: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MURMUR_KERNELS", "MURMUR_COMPILE")}
    if impl == "default":
        return env
    env["MURMUR_COMPILE"] = "off"  # the whole-model torch.compile below, or none
    if impl != "compile+fused_adamw":  # that row keeps the model's own kernel choice, as default
        env["MURMUR_KERNELS"] = (
            "triton" if impl.startswith("fused") else "linear_cross_entropy" if impl == "compile+xent" else "torch"
        )
    return env


def measure(preset: str, impl: str, batch: int, steps: int, warmup: int, data: str | None,
            profile: str | None) -> dict:
    import torch

    from murmur.node.model.transformer import Transformer, model_config
    from murmur.optim.inner import make_inner_optimizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_config(preset)
    model = Transformer(cfg, seed=0).to(device)
    # The run config's optimizer defaults (protocol.runconfig.OptimSection), spelled out so the
    # benchmark needs nothing beyond torch and triton on the GPU machine.
    optim_cfg = SimpleNamespace(lr=4e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    if impl in ("default", "compile+fused_adamw"):
        opt = make_inner_optimizer(model, optim_cfg)
    else:  # torch's AdamW with its own implementation choice, over the same parameter groups
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim_cfg.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)
    group = opt.param_groups[0]
    # torch takes foreach on a GPU when the optimizer is not told
    adamw_impl = ("fused" if group.get("fused") else
                  "foreach" if group.get("foreach") or device.type == "cuda" else "for-loop")
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

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        # bf16 autocast on a GPU, as the trainer's dtype=auto
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    t_warm = time.perf_counter()
    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t_warm = time.perf_counter() - t_warm
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    host_ms = []
    t0 = time.perf_counter()
    for i in range(steps):
        if cuda:
            events[i].record()
        h0 = time.perf_counter()
        loss = step(i)
        host_ms.append(1000 * (time.perf_counter() - h0))
    if cuda:
        events[steps].record()
    final_loss = float(loss)  # synchronizes
    seconds = time.perf_counter() - t0
    step_ms = [events[i].elapsed_time(events[i + 1]) for i in range(steps)] if cuda else []
    tokens_per_s = steps * batch * cfg.seq_len / seconds
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = MEASURED_TFLOPS.get(name)
    from torch._dynamo.utils import counters

    row = {
        "preset": preset,
        "params_m": round(cfg.num_params() / 1e6, 1),
        "impl": impl,
        "batch": batch,
        "seq_len": cfg.seq_len,
        "dtype": "bf16" if cuda else "fp32",
        "steps": steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "ms_per_step": round(1000 * seconds / steps, 2),
        "mfu": round(cfg.flops_per_token() * tokens_per_s / (peak * 1e12), 4) if peak else None,
        "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "device_mem_mb": round(torch.cuda.mem_get_info()[1] / 2**20, 1) if cuda else None,
        "step_ms_min_med_max": [round(min(step_ms), 2), round(statistics.median(step_ms), 2),
                                round(max(step_ms), 2)] if step_ms else None,
        "host_ms_per_step": round(statistics.median(host_ms), 2),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": sorted(counters["graph_break"])[:3],
        "recompiles": sum(v for k, v in counters["stats"].items() if k == "unique_graphs"),
        "warmup_s": round(t_warm, 1),
        "final_loss": round(final_loss, 4),
        "adamw": adamw_impl,
        "device": name,
    }
    if profile and cuda:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for i in range(3):
                step(i)
            torch.cuda.synchronize()
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)
        Path(profile).mkdir(parents=True, exist_ok=True)
        (Path(profile) / f"profile_{preset}_{impl.replace('+', '_')}.txt").write_text(table)
    return row


def run_one(args, impl: str, batch: int, profile: str | None = None, steps: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--one", impl, "--preset", args.preset, "--batch", str(batch),
           "--steps", str(steps or args.steps), "--warmup", str(1 if steps else args.warmup)]
    cmd += (["--data", args.data] if args.data else []) + (["--profile", profile] if profile else [])
    proc = subprocess.run(cmd, env=impl_env(impl), capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")), None)
    if proc.returncode or not line:
        err = proc.stderr[-3000:]
        return {"preset": args.preset, "impl": impl, "batch": batch,
                "error": "out of memory" if "OutOfMemoryError" in err else err[-500:]}
    return json.loads(line[4:])


def fits(args, impl: str, batch: int) -> dict | None:
    """Two training steps at ``batch`` (one process): the row, or None when they ran out of memory."""
    row = run_one(args, impl, batch, steps=2)
    return None if "error" in row else row


def max_batch(args, impl: str, measured: dict) -> int:
    """The largest batch whose training steps run without running out of memory, to within 1/16.

    Peak memory grows linearly with the batch: two measured points (``measured``, the row at
    --batch, and a try at twice it) predict where the device is full. Tries walk down from the
    prediction (the allocator's fragmentation makes it overshoot by a few percent) or up from it,
    then bisection closes the gap; each try is a fresh process of two steps, compile included."""
    b1, p1 = measured["batch"], measured["peak_mem_mb"]
    second = fits(args, impl, 2 * b1)
    lo, hi = (2 * b1, None) if second is not None else (b1, 2 * b1)
    if second is not None:
        per_sample = (second["peak_mem_mb"] - p1) / b1
        guess = int(b1 + (measured["device_mem_mb"] - p1) / per_sample) if per_sample > 0 else 4 * b1
        cand = max(guess, lo + 1)
        if fits(args, impl, cand) is not None:
            lo = cand
            while hi is None:
                cand = lo + max(1, lo // 8)
                lo, hi = (cand, None) if fits(args, impl, cand) is not None else (lo, cand)
        else:
            hi = cand
            for _ in range(3):  # a few steps down; bisection takes a prediction far off
                cand = int(hi * 0.93)
                if cand <= lo:
                    break
                if fits(args, impl, cand) is not None:
                    lo = cand
                    break
                hi = cand
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(args, impl, mid) is not None else (lo, mid)
    return lo


def summary(rows: list[dict]) -> dict:
    """default against compile alone and eager, per preset at batch 16, with the issue's targets."""
    out: dict = {}
    for preset in sorted({r["preset"] for r in rows}):
        tps = {r["impl"]: r["tokens_per_s"] for r in rows
               if r["preset"] == preset and r.get("batch") == 16 and "tokens_per_s" in r}
        if "default" not in tps:
            continue
        for base in ("compile", "eager"):
            if base in tps:
                out[f"default_over_{base}_{preset}"] = round(tps["default"] / tps[base], 3)
        # --max-batch: the largest batch of each impl, and default against compile each at its own.
        found = {r["impl"]: r["max_batch"] for r in rows
                 if r["preset"] == preset and r.get("batch") == 16 and r.get("max_batch")}
        if found:
            out[f"max_batch_{preset}"] = found
            at = {i: next((r["tokens_per_s"] for r in rows if r["preset"] == preset and r["impl"] == i
                           and r.get("batch") == b and "tokens_per_s" in r), None) for i, b in found.items()}
            if at.get("default") and at.get("compile"):
                out[f"default_over_compile_{preset}_each_at_its_max_batch"] = round(at["default"] / at["compile"], 3)
    targets = {}
    if "default_over_compile_base" in out:
        targets["default >= 1.15x compile (base)"] = out["default_over_compile_base"] >= 1.15
    if "default_over_eager_base" in out:
        targets["default >= 1.5x eager (base)"] = out["default_over_eager_base"] >= 1.5
    out["targets"] = targets
    return out


def git_commit() -> str | None:
    if os.environ.get("MURMUR_COMMIT"):
        return os.environ["MURMUR_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--impls", default="eager,compile")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per impl (median and spread)")
    ap.add_argument("--max-batch", action="store_true", help="also search the largest batch that fits")
    ap.add_argument("--profile", help="write a torch.profiler table per impl into this folder")
    ap.add_argument("--data", help="a prepared dataset folder (default: random tokens)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one impl, print JSON
    args = ap.parse_args()

    if args.one:
        row = measure(args.preset, args.one, args.batch, args.steps, args.warmup, args.data, args.profile)
        print("ROW " + json.dumps(row))
        return

    rows = []
    for impl in args.impls.split(","):
        if impl not in IMPLS:
            sys.exit(f"unknown impl {impl!r}: choose from {','.join(IMPLS)}")
        runs = [run_one(args, impl, args.batch, args.profile if r == 0 else None) for r in range(args.repeats)]
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"{impl}: failed\n{runs[0]['error']}", file=sys.stderr)
            rows.append(runs[0])
            continue
        tps = sorted(r["tokens_per_s"] for r in good)
        row = min(good, key=lambda r: abs(r["tokens_per_s"] - statistics.median(tps)))
        row = dict(row, tokens_per_s=round(statistics.median(tps), 1), runs_tokens_per_s=tps,
                   spread_pct=round(100 * (tps[-1] - tps[0]) / statistics.median(tps), 1) if len(tps) > 1 else None)
        if args.max_batch and row.get("peak_mem_mb"):
            row["max_batch"] = max_batch(args, impl, row)
            rows.append(row)
            # Throughput at that batch: a row of its own (rows are keyed by preset, impl and batch).
            at_max = run_one(args, impl, row["max_batch"])
            if "error" not in at_max:
                at_max["runs_tokens_per_s"] = [at_max["tokens_per_s"]]
                rows.append(at_max)
        else:
            rows.append(row)
        print(f"{row['preset']:6s} {impl:14s} {row['tokens_per_s']:>12,.0f} tok/s  runs {tps}  mfu {row['mfu']}  "
              f"steps {row['step_ms_min_med_max']} ms  host {row['host_ms_per_step']} ms  peak "
              f"{row['peak_mem_mb']} MB  breaks {row['graph_breaks']}  max_batch {row.get('max_batch')}", flush=True)

    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {"rows": []}
    new_keys = {(r["preset"], r["impl"], r["batch"]) for r in rows}
    keep = [r for r in old.get("rows", []) if (r.get("preset"), r.get("impl"), r.get("batch")) not in new_keys]
    import torch

    commit = git_commit()
    for r in rows:
        r.setdefault("commit", commit)
    commands = dict(old.get("commands", {}))
    commands.setdefault(commit or "unknown", []).append("python3 " + " ".join(sys.argv))
    all_rows = keep + rows
    result = {
        **old,  # sections written by hand (findings, variance probes) stay
        "benchmark": "train_throughput",
        "device": next((r["device"] for r in rows if "device" in r), old.get("device", "unknown")),
        "date": dt.date.today().isoformat(),
        "commands": commands,
        "commit": commit,
        "torch": torch.__version__,
        "peak_tflops": {"measured": MEASURED_TFLOPS, "datasheet": DATASHEET_TFLOPS},
        "notes": old.get("notes") or "tokens/s of AdamW training steps with grad clipping, bf16 autocast on a "
                 "GPU, random "
                 "tokens; adamw names the AdamW implementation of the row (torch's default, foreach, "
                 "for every row but default and compile+fused_adamw); mfu against the measured dense "
                 "bf16 matrix rate (790 TFLOP/s); tokens_per_s is the median of runs_tokens_per_s "
                 "(fresh processes), spread_pct their range over the median; eager = pure-torch "
                 "reference ops; each row names the commit it ran from",
        "summary": summary(all_rows),
        "rows": all_rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
