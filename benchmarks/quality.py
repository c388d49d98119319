"""Quality benchmark: validation loss against bytes sent, every algorithm at one token budget.

8 workers of a ~30M-parameter Llama-style model (GPT-2 BPE) in `murmur sim`'s stacked engine, on
Shakespeare + the Python 3.11 docs + the Linux 6.1 docs. Rows: DDP (fp32 gradients every step),
DiLoCo at H in {50, 100, 250} with fp32 / int8 / int4, Streaming DiLoCo, DeMo, DiLoCo with
top-k + 2-bit values and error feedback (SparseLoCo-style), and plain model averaging.

    # the corpus, here (apt + network): data/quality-gpt2, 13.4M train tokens; carry it to the GPU
    bash benchmarks/quality_corpus.sh
    # the committed run: two calls on 2 H200s, 4 lanes (processes) each, rows split between them
    source benchmarks/gpu_env.sh && python3 benchmarks/quality.py --data data/quality-gpt2 \
        --steps 2000 --lanes 0,0,1,1 --rows ddp,diloco-fp32-H50,... --partial-dir $OUT
    # then, here: merge the calls' JSONs (and the small CPU sweep) into results/quality.json
    python3 benchmarks/quality.py --combine A.json,B.json cpu.json --note "..."

With ``--time-budget-s`` and no ``--steps``, a short probe times one step of each kind and the
largest step count (a multiple of 500, so every H divides it) that fits the budget is used for every
row. The JSON (and the PNG) are rewritten after each row, so a run cut short still leaves data.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from murmur.node.data import Dataset
from murmur.node.sim import SimResult, plot_loss_vs_bytes, run_sim
from murmur.node.train import resolve_device
from murmur.protocol.runconfig import RunConfig, config_from_dict

RESULTS = Path(__file__).resolve().parent / "results"
STEP_CHOICES = (3000, 2500, 2000, 1500, 1000, 500)  # multiples of every H: each row ends on a sync
PROBE_STEPS = 8

BASE = {
    "name": "quality",
    "seed": 0,
    "model": {"preset": "medium", "dim": 384, "n_layers": 6, "n_heads": 6, "n_kv_heads": 6,
              "hidden_dim": 1024, "seq_len": 256},
    "data": {"tokenizer": "gpt2"},
    "optim": {"lr": 1e-3, "warmup_steps": 50, "weight_decay": 0.1, "min_lr_ratio": 0.1},
    "train": {"batch_size": 8, "eval_every": 50, "eval_batches": 16},
    "sync": {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "overlap_steps": 0},
}

# name -> (sync overrides, optim overrides)
ROWS: dict[str, tuple[dict, dict]] = {"ddp": ({"algorithm": "ddp", "inner_steps": 50}, {})}
for _h in (50, 100, 250):
    for _c in ("fp32", "int8", "int4"):
        ROWS[f"diloco-{_c}-H{_h}"] = ({"algorithm": "diloco", "inner_steps": _h, "codec": _c}, {})
ROWS["streaming-int4-H100"] = (
    {"algorithm": "streaming", "inner_steps": 100, "fragments": 4, "overlap_steps": 5, "mix_alpha": 0.0,
     "codec": "int4"},
    {},
)
ROWS["streaming-int4-H250"] = (
    {"algorithm": "streaming", "inner_steps": 250, "fragments": 4, "overlap_steps": 5, "mix_alpha": 0.0,
     "codec": "int4"},
    {},
)
# Plain model averaging every 50 steps (outer lr 1, no momentum): local SGD, the check on what
# DiLoCo's outer Nesterov step adds.
ROWS["avg-fp32-H50"] = ({"algorithm": "diloco", "inner_steps": 50, "codec": "fp32", "outer_lr": 1.0,
                         "outer_momentum": 0.0}, {})
# DeMo's sign update moves every weight by lr each step: it wants a smaller lr than AdamW.
ROWS["demo"] = ({"algorithm": "demo", "inner_steps": 50, "demo_topk": 32, "demo_chunk": 64}, {"lr": 3e-4})
# SparseLoCo: top-k 1.56% of each 4096-chunk, 2-bit values, error feedback with decay 0.95, outer
# lr 1 with no outer momentum (the error feedback carries what momentum would).
ROWS["diloco-topk2bit-H50"] = (
    {"algorithm": "diloco", "inner_steps": 50, "codec": "topk2bit", "topk_fraction": 0.0156, "ef_decay": 0.95,
     "outer_lr": 1.0, "outer_momentum": 0.0},
    {},
)


def row_config(name: str, data: str, steps: int) -> RunConfig:
    sync, optim = ROWS[name]
    d = copy.deepcopy(BASE)
    d["data"]["path"] = data
    d["train"]["steps"] = steps
    d["sync"].update(sync)
    d["optim"].update(optim)
    return config_from_dict(d)


def probe_seconds_per_step(names: list[str], data: str, workers: int, device, dataset: Dataset) -> float:
    """Seconds one global step takes, summed over ``names`` (measured on a few steps of each)."""
    total = 0.0
    kinds: dict[str, float] = {}
    for name in names:
        kind = ROWS[name][0]["algorithm"]
        if kind not in kinds:
            cfg = row_config(name, data, PROBE_STEPS)
            cfg.sync.inner_steps = min(cfg.sync.inner_steps, PROBE_STEPS)
            cfg.sync.overlap_steps = 0
            cfg.train.eval_every = 10**9
            cfg.train.eval_batches = 1
            r = run_sim(cfg, workers, device, dataset, log=lambda s: None)
            kinds[kind] = r.seconds / PROBE_STEPS
            print(f"probe {kind}: {kinds[kind] * 1000:.0f} ms per step of {workers} workers", flush=True)
        total += kinds[kind]
    return total


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def rows_of(results: list[SimResult], names: list[str]) -> list[dict]:
    ddp = next((r for r in results if r.algorithm == "ddp"), None)
    out = []
    for name, r in zip(names, results, strict=False):
        gap = 100 * (r.val_loss - ddp.val_loss) / ddp.val_loss if ddp else None
        out.append({
            "name": name, "algo": r.algorithm, "codec": r.codec, "H": r.inner_steps, "workers": r.workers,
            "tokens": r.tokens, "val_loss": round(r.val_loss, 4),
            "loss_gap_pct": None if gap is None else round(gap, 2),
            "bytes_per_worker": r.bytes_per_worker,
            "reduction_vs_ddp": round(r.ddp_bytes_per_worker / r.bytes_per_worker, 1) if r.bytes_per_worker else None,
            "seconds": round(r.seconds, 1),
        })
    return out


def summarize(rows: list[dict]) -> dict:
    within = [r for r in rows if r["loss_gap_pct"] is not None and r["loss_gap_pct"] <= 2.0 and r["algo"] != "ddp"]
    best = max(within, key=lambda r: r["reduction_vs_ddp"] or 0, default=None)
    notes = {"best_within_2pct": best and {k: best[k] for k in ("name", "reduction_vs_ddp", "loss_gap_pct")}}
    for h in (50, 100, 250):
        a = next((r for r in rows if r["name"] == f"diloco-fp32-H{h}"), None)
        b = next((r for r in rows if r["name"] == f"diloco-int4-H{h}"), None)
        if a and b:
            notes[f"int4_vs_fp32_H{h}_pct"] = round(100 * (b["val_loss"] - a["val_loss"]) / a["val_loss"], 2)
    return notes


def write(out_paths: list[Path], payload: dict, results: list[SimResult], names: list[str]) -> None:
    for d in out_paths:
        d.mkdir(parents=True, exist_ok=True)
        (d / "quality.json").write_text(json.dumps(payload, indent=1) + "\n")
        if results:
            plot_loss_vs_bytes(
                results, d / "quality.png",
                f"{results[0].workers} workers, {results[0].n_params / 1e6:.0f}M params, "
                f"{results[0].tokens / 1e6:.1f}M tokens per run: val loss vs bytes sent",
                labels=names,
            )


def plot_panels(panels: list[tuple[str, dict]], path: Path) -> None:
    """One panel per run set: validation loss against bytes sent per worker (log x), from the
    JSON curves ({name: [[step, tokens, bytes, val_loss], ...]})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), dpi=120, squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels, strict=True):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 13+ runs: no colour used twice
        for name, pts in curves.items():
            pts = [p for p in pts if p[2] > 0]
            if pts:
                style = "-" if name.startswith(("ddp", "diloco-fp32")) else "--"
                ax.plot([p[2] for p in pts], [p[3] for p in pts], style, marker="o", markersize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker (log scale)")
        ax.set_ylabel("validation loss")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def merge_sweeps(parts: list[dict]) -> dict:
    """Several runs of one sweep (rows split over processes) as one: gaps against its DDP row."""
    merged = dict(parts[0])
    seen: set[str] = set()
    merged["rows"] = [r for part in parts for r in part["rows"] if not (r["name"] in seen or seen.add(r["name"]))]
    order = {n: i for i, n in enumerate(ROWS)}  # the table's row order, whichever part ran a row
    merged["rows"].sort(key=lambda r: order.get(r["name"], len(order)))
    merged["curves"] = {k: v for part in parts for k, v in part["curves"].items()}
    merged["command"] = " ; ".join(part["command"] for part in parts)
    ddp = next((r for r in merged["rows"] if r["algo"] == "ddp"), None)
    for r in merged["rows"]:
        if ddp:
            r["loss_gap_pct"] = round(100 * (r["val_loss"] - ddp["val_loss"]) / ddp["val_loss"], 2)
    merged["summary"] = summarize(merged["rows"])
    return merged


def combine(gpu_paths: list[Path], cpu_paths: list[Path], out_dir: Path, notes: list[str]) -> None:
    """The committed result: the GPU run's rows at top level (merged when its rows ran in several
    calls), the complete small CPU sweep beside."""
    gpu = merge_sweeps([json.loads(p.read_text()) for p in gpu_paths])
    gpu["curves"] = {r["name"]: gpu["curves"][r["name"]] for r in gpu["rows"]}
    gpu.pop("lanes", None)  # per call; the commands say how the rows were split
    cpu = merge_sweeps([json.loads(p.read_text()) for p in cpu_paths])
    merged = dict(gpu)
    keys = ("device", "date", "command", "model", "train", "optim", "workers", "steps_per_worker", "corpus",
            "rows", "summary", "curves")
    merged["cpu_sweep"] = {k: cpu[k] for k in keys if k in cpu}
    merged["notes"] = notes
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quality.json").write_text(json.dumps(merged, indent=1) + "\n")
    g_m, c_m = gpu["model"], cpu["model"]
    plot_panels(
        [
            (f"{gpu['device']}: {gpu['workers']} workers, {g_m['params'] / 1e6:.0f}M params, "
             f"{gpu['steps_per_worker']} steps ({gpu['rows'][0]['tokens'] / 1e6:.1f}M tokens)", gpu["curves"]),
            (f"{cpu['device']}: {cpu['workers']} workers, {c_m['params'] / 1e6:.2f}M params (bytes), "
             f"{cpu['steps_per_worker']} steps ({cpu['rows'][0]['tokens'] / 1e6:.1f}M tokens)", cpu["curves"]),
        ],
        out_dir / "quality.png",
    )


# Relative cost of a row's inner step (DDP all-reduces and DeMo all-gathers every step), to
# spread the rows evenly over lanes.
ROW_COST = {"ddp": 1.4, "demo": 1.4}


def split_rows(names: list[str], lanes: int) -> list[list[str]]:
    """Greedy: the costliest rows first, each to the lane with the least work so far."""
    load, out = [0.0] * lanes, [[] for _ in range(lanes)]
    for name in sorted(names, key=lambda n: -ROW_COST.get(ROWS[n][0]["algorithm"], 1.0)):
        i = load.index(min(load))
        out[i].append(name)
        load[i] += ROW_COST.get(ROWS[name][0]["algorithm"], 1.0)
    return [lane for lane in out if lane]


def _drop_options(argv: list[str], names: set[str]) -> list[str]:
    """argv without ``--name value`` / ``--name=value`` for the given option names."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not any(a.startswith(n + "=") for n in names):
            out.append(a)
    return out


def run_lanes(args: argparse.Namespace, argv: list[str]) -> int:
    """One child process per lane (its own CUDA device and rows), then one merged JSON and PNG."""
    import os
    import subprocess

    if not args.steps:
        print("error: --lanes needs --steps (each lane cannot fit a shared time budget)", file=sys.stderr)
        return 2
    names = args.rows.split(",") if args.rows else list(ROWS)
    devices = args.lanes.split(",")
    groups = split_rows(names, len(devices))
    # Flat (OUT/lane0, ...): the GPU machine's tool brings back files only a few folders deep.
    root = Path(args.partial_dir or args.results_dir)
    base = _drop_options(argv, {"--lanes", "--rows", "--results-dir", "--partial-dir"})
    procs = []
    for i, rows in enumerate(groups):
        out = root / f"lane{i}"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices[i])
        cmd = [sys.executable, __file__, *base, "--rows", ",".join(rows), "--results-dir", str(out)]
        print(f"lane {i} on cuda:{devices[i]}: {', '.join(rows)}", flush=True)
        log = (out / "log.txt").open("w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, out))
    rc = 0
    for proc, log, out in procs:
        rc |= proc.wait()
        log.close()
        tail = (out / "log.txt").read_text().splitlines()[-3:]
        print(f"{out.name}: rc {proc.returncode}; " + " | ".join(tail), flush=True)
    parts = [json.loads((out / "quality.json").read_text()) for _, _, out in procs if (out / "quality.json").exists()]
    if not parts:
        return rc or 1
    merged = merge_sweeps(parts)
    merged["command"] = "python3 benchmarks/quality.py " + " ".join(argv)
    merged["lanes"] = {f"lane{i} (cuda:{devices[i]})": rows for i, rows in enumerate(groups)}
    for d in [Path(args.results_dir)] + ([Path(args.partial_dir)] if args.partial_dir else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / "quality.json").write_text(json.dumps(merged, indent=1) + "\n")
        title = (f"{merged['device']}: {merged['workers']} workers, {merged['model']['params'] / 1e6:.0f}M params, "
                 f"{merged['steps_per_worker']} steps ({merged['rows'][0]['tokens'] / 1e6:.0f}M tokens) per run")
        plot_panels([(title, {r["name"]: merged["curves"][r["name"]] for r in merged["rows"]})], d / "quality.png")
    print(json.dumps(merged["summary"], indent=1))
    for r in merged["rows"]:
        print(json.dumps(r))
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/quality-gpt2")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, help="inner steps per worker for every row (default: fit the budget)")
    p.add_argument("--time-budget-s", type=float, default=420.0, help="wall time for all rows")
    p.add_argument("--rows", help="comma-separated subset of: " + ", ".join(ROWS))
    p.add_argument("--set", action="append", default=[], help="override a base key, e.g. model.n_layers=2")
    p.add_argument("--partial-dir", help="also write the JSON/PNG here after each row (e.g. $OUT)")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--combine", nargs="+", metavar="JSON",
                   help="GPU_JSON[,GPU_JSON...] CPU_JSON [CPU_JSON ...]: merge a GPU run and a CPU sweep (either "
                   "may be split over several runs) into --results-dir/quality.json and .png")
    p.add_argument("--note", action="append", default=[], help="a note for the combined JSON (repeatable)")
    p.add_argument("--engine", default="stacked", help="the simulator's engine: stacked (default) or threads")
    p.add_argument("--lanes", help="run the rows in parallel processes, one per entry, on these CUDA devices "
                   "(e.g. 0,0,1,1: two on each of two GPUs); needs --steps; the lanes' JSONs are merged")
    args = p.parse_args(argv)
    if args.lanes:
        return run_lanes(args, argv if argv is not None else sys.argv[1:])
    if args.combine:
        if len(args.combine) < 2:
            p.error("--combine needs a GPU JSON and at least one CPU JSON")
        gpu_parts = [Path(x) for x in args.combine[0].split(",")]
        combine(gpu_parts, [Path(x) for x in args.combine[1:]], Path(args.results_dir), args.note)
        return 0
    t_start = time.perf_counter()
    for item in args.set:
        key, raw = item.split("=", 1)
        section, name = key.split(".")
        try:
            BASE[section][name] = json.loads(raw)
        except json.JSONDecodeError:
            BASE[section][name] = raw  # a bare word is a string
    names = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"error: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    dataset = Dataset.open(args.data)
    steps = args.steps
    if steps is None:
        per_step = probe_seconds_per_step(names, args.data, args.workers, device, dataset)
        left = args.time_budget_s - (time.perf_counter() - t_start)
        # 15% for evaluation and the first steps' warm-up.
        steps = next((s for s in STEP_CHOICES if s * per_step * 1.15 <= left), STEP_CHOICES[-1])
        print(f"budget: {left:.0f}s left, {per_step:.2f}s per step of all rows -> {steps} steps per row", flush=True)
    out_paths = [Path(args.results_dir)] + ([Path(args.partial_dir)] if args.partial_dir else [])
    results: list[SimResult] = []
    done: list[str] = []
    payload: dict = {}
    for name in names:
        cfg = row_config(name, args.data, steps)
        print(f"== {name}", flush=True)
        r = run_sim(cfg, args.workers, device, dataset, engine=args.engine, log=lambda s: print(s, flush=True))
        results.append(r)
        done.append(name)
        rows = rows_of(results, done)
        payload = {
            "device": device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python3 benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "model": {"params": r.n_params, **BASE["model"]},
            "train": {k: BASE["train"][k] for k in ("batch_size", "eval_every", "eval_batches")},
            "optim": BASE["optim"],
            "workers": args.workers,
            "steps_per_worker": steps,
            "corpus": f"{args.data}: {sum(dataset.shard_size(i) for i in range(dataset.num_shards)):,} train tokens",
            "rows": rows,
            "summary": summarize(rows),
            "curves": {n: [[p.step, p.tokens, p.bytes_sent, round(p.val_loss, 4)] for p in x.curve]
                       for n, x in zip(done, results, strict=True)},
            "curve_columns": ["step", "tokens", "bytes_sent_per_worker", "val_loss"],
        }
        write(out_paths, payload, results, done)
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(payload.get("summary"), indent=1))
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
