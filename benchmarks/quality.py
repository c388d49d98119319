"""Quality benchmark: validation loss against bytes sent, every algorithm at one token budget.

8 workers of a ~30M-parameter Llama-style model (GPT-2 BPE) in `murmur sim`'s stacked engine, on
Shakespeare + the Python 3.11 docs + the Linux 6.1 docs. Rows: DDP (fp32 gradients every step),
DiLoCo at H in {50, 100, 250} with fp32 / int8 / int4, Streaming DiLoCo, DeMo, DiLoCo with
top-k + 2-bit values and error feedback (SparseLoCo-style), and plain model averaging.

    # the corpus, here (apt + network): data/quality-gpt2, 13.4M train tokens; carry it to the GPU
    bash benchmarks/quality_corpus.sh
    # the committed run (2 H200s, 8 lanes): one model trained 1000 steps at DDP's global batch (the
    # warm start), then every row 1000 steps from its weights and AdamW state, DiLoCo's outer step
    # set to plain averaging; the batch16/batch32 sections add --set train.batch_size=16 --steps 500
    # --warm-start-steps 500 (and 32, 250, 250) at the same token budget
    source benchmarks/gpu_env.sh && python3 benchmarks/quality.py --data data/quality-gpt2 \
        --steps 1000 --warm-start-steps 1000 --set sync.outer_lr=1.0 --set sync.outer_momentum=0.0 \
        --lanes 0,0,0,0,1,1,1,1 --lane-deadline-s 480 --lane-dir /tmp/lanes --rows ddp,... --partial-dir $OUT
    # then, here: merge the calls' JSONs, keeping earlier sweeps beside under their own names
    python3 benchmarks/quality.py --combine A.json,B.json --section cpu_sweep=cpu.json --note "..."

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
import textwrap
import time
from pathlib import Path

import torch

from murmur.node.model.data import Dataset
from murmur.node.sim.replicas import read_warm_start
from murmur.node.sim.report import SimResult, plot_loss_vs_bytes
from murmur.node.sim.run import run_sim
from murmur.node.testnet.procs import stop_process
from murmur.node.train.build import resolve_device
from murmur.node.train.trainer import Trainer
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
# Plain model averaging (outer lr 1, no momentum): local SGD, the check on what DiLoCo's outer
# Nesterov step adds, every 50 steps in fp32 and every 250 in int4 (1778x less than DDP).
for _name, _h, _c in (("avg-fp32-H50", 50, "fp32"), ("avg-int4-H250", 250, "int4")):
    ROWS[_name] = ({"algorithm": "diloco", "inner_steps": _h, "codec": _c, "outer_lr": 1.0, "outer_momentum": 0.0}, {})
# DiLoCo's published outer step (SGD lr 0.7, Nesterov momentum 0.9), named for comparison when the
# table's outer optimizer is set otherwise (--set sync.outer_lr=1 --set sync.outer_momentum=0).
for _name, _h, _c in (("nesterov-fp32-H50", 50, "fp32"), ("nesterov-int4-H250", 250, "int4")):
    ROWS[_name] = ({"algorithm": "diloco", "inner_steps": _h, "codec": _c, "outer_lr": 0.7, "outer_momentum": 0.9,
                    "nesterov": True}, {})
# An outer lr above 1 with no momentum: averaging 8 noisy pseudo-gradients cancels their noise and
# shrinks the step, which a larger outer step gives back (few rounds: momentum has no time to build).
for _lr in (1.5, 2, 3):
    for _h in (50, 100, 250):
        ROWS[f"outer{_lr}-int4-H{_h}"] = ({"algorithm": "diloco", "inner_steps": _h, "codec": "int4",
                                           "outer_lr": float(_lr), "outer_momentum": 0.0}, {})
ROWS["outer1-nesterov0.5-int4-H50"] = ({"algorithm": "diloco", "inner_steps": 50, "codec": "int4", "outer_lr": 1.0,
                                        "outer_momentum": 0.5, "nesterov": True}, {})
# A lower inner lr: each worker steps on an eighth of DDP's batch, so the lr tuned for DDP's batch
# (and the warm start) is noisier for it.
for _lr in ("2e-4", "3e-4", "5e-4"):
    for _h in (50, 100, 250):
        for _c in ("fp32", "int4"):
            ROWS[f"diloco-{_c}-H{_h}-lr{_lr}"] = ({"algorithm": "diloco", "inner_steps": _h, "codec": _c},
                                                 {"lr": float(_lr)})
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


def warm_start(data: str, steps: int, batch: int, device: torch.device, path: Path) -> dict:
    """Train one model for ``steps`` steps of ``batch`` sequences (DDP's global batch: the same
    update DDP would make) and save its weights and AdamW state to ``path``: the DiLoCo paper's
    warm start, which every row then continues from. The learning rate stays at its peak after
    warm-up (min_lr_ratio 1), so the rows' own schedules continue one schedule instead of restarting
    a decayed one."""
    d = copy.deepcopy(BASE)
    d["data"]["path"] = data
    d["train"].update(steps=steps, batch_size=batch)
    d["optim"]["min_lr_ratio"] = 1.0
    cfg = config_from_dict(d)
    torch.manual_seed(cfg.seed)
    dataset = Dataset.open(data)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, dataset, device)
    before = trainer.validate()
    for _ in range(steps):
        trainer.step()
    val = trainer.validate()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict()}, path)
    info = {"steps": steps, "batch_size": batch, "tokens": steps * batch * trainer.model.cfg.seq_len,
            "lr_after_warmup": "constant", "val_loss_before": round(before, 4), "val_loss": round(val, 4),
            "seconds": round(time.perf_counter() - t0, 1)}
    print(f"warm start: {json.dumps(info)}", flush=True)
    return info


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
    def brief(r: dict | None) -> dict | None:
        return r and {k: r[k] for k in ("name", "reduction_vs_ddp", "loss_gap_pct")}

    others = [r for r in rows if r["loss_gap_pct"] is not None and r["algo"] != "ddp"]
    best = max((r for r in others if r["loss_gap_pct"] <= 2.0), key=lambda r: r["reduction_vs_ddp"] or 0, default=None)
    notes = {
        "best_within_2pct": brief(best),
        # Where we stand when nothing is within 2%: the smallest gap, overall and at >= 1000x.
        "smallest_gap": brief(min(others, key=lambda r: r["loss_gap_pct"], default=None)),
        "smallest_gap_at_1000x": brief(min((r for r in others if (r["reduction_vs_ddp"] or 0) >= 1000),
                                           key=lambda r: r["loss_gap_pct"], default=None)),
    }
    for h in (50, 100, 250):
        a = next((r for r in rows if r["name"] == f"diloco-fp32-H{h}"), None)
        b = next((r for r in rows if r["name"] == f"diloco-int4-H{h}"), None)
        if a and b:
            notes[f"int4_vs_fp32_H{h}_pct"] = round(100 * (b["val_loss"] - a["val_loss"]) / a["val_loss"], 2)
    return notes


def write(out_paths: list[Path], payload: dict, results: list[SimResult], names: list[str]) -> None:
    for d in out_paths:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "quality.json.tmp"
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(d / "quality.json")  # atomic: a lane stopped at its deadline leaves a whole JSON
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

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.5 * rows), dpi=120, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, curves) in zip(axes.flat, panels, strict=False):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 13+ runs: no colour used twice
        for name, pts in curves.items():
            pts = [p for p in pts if p[2] > 0]
            if pts:
                style = "-" if name.startswith(("ddp", "diloco-fp32")) else "--"
                ax.plot([p[2] for p in pts], [p[3] for p in pts], style, marker="o", markersize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker (log scale)")
        ax.set_ylabel("validation loss")
        ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
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


SWEEP_KEYS = ("device", "date", "command", "model", "train", "optim", "workers", "steps_per_worker", "corpus",
              "warm_start", "rows", "summary", "curves", "notes")


def panel_title(sweep: dict) -> str:
    m = sweep["model"]
    warm = sweep.get("warm_start")
    start = f"after a {warm['steps']}-step warm start" if warm else "from scratch"
    batch = sweep.get("train", {}).get("batch_size")
    per_worker = f" of {batch}x{m['seq_len']} tokens" if batch and "seq_len" in m else ""
    return (f"{sweep['device']}: {sweep['workers']} workers, {m['params'] / 1e6:.2f}M params, "
            f"{sweep['steps_per_worker']} steps{per_worker} ({sweep['rows'][0]['tokens'] / 1e6:.1f}M tokens) {start}")


def combine(main_paths: list[Path], sections: dict[str, list[Path]], out_dir: Path, notes: list[str]) -> None:
    """The committed result: the main sweep's rows at top level (merged when its rows ran in
    several calls), each other sweep (an earlier regime, the small CPU sweep) under its name."""
    main = merge_sweeps([json.loads(p.read_text()) for p in main_paths])
    main["curves"] = {r["name"]: main["curves"][r["name"]] for r in main["rows"]}
    main.pop("lanes", None)  # per call; the commands say how the rows were split
    merged = dict(main)
    panels = [(panel_title(main), main["curves"])]
    for name, paths in sections.items():
        sweep = merge_sweeps([json.loads(p.read_text()) for p in paths])
        merged[name] = {k: sweep[k] for k in SWEEP_KEYS if k in sweep}
        panels.append((f"{name}: {panel_title(sweep)}", sweep["curves"]))
    merged["notes"] = notes
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quality.json").write_text(json.dumps(merged, indent=1) + "\n")
    plot_panels(panels, out_dir / "quality.png")


# Relative cost of a row's inner step (DDP all-reduces and DeMo all-gathers every step), to
# spread the rows evenly over lanes.
ROW_COST = {"ddp": 1.4, "demo": 1.4}  # measured on 2 H200s, 4 lanes each: 242 s, 232 s, DiLoCo 135-172 s


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
    # The lanes' own JSONs and logs; only the merged JSON and PNG go to the results folders.
    root = Path(args.lane_dir or args.partial_dir or args.results_dir)
    base = _drop_options(argv, {"--lanes", "--rows", "--results-dir", "--partial-dir", "--warm-start-steps",
                                "--lane-dir", "--lane-deadline-s"})
    warm = None
    if args.warm_start_steps:
        # Once, before the lanes, which all continue from it (outside OUT: it is large).
        ckpt = Path(args.warm_dir) / "warm.pt"
        warm = warm_start(args.data, args.warm_start_steps, args.workers * BASE["train"]["batch_size"],
                          torch.device(f"cuda:{devices[0]}" if torch.cuda.is_available() else "cpu"), ckpt)
        base += ["--init-from", str(ckpt), "--warm-info", json.dumps(warm)]
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
    deadline = time.monotonic() + args.lane_deadline_s if args.lane_deadline_s else None
    for proc, log, out in procs:
        try:
            rc |= proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # Past the deadline: stop the lane; its finished rows are in its JSON already.
            stop_process(proc, timeout_s=10)
            rc |= 1
            print(f"{out.name}: stopped at the deadline ({args.lane_deadline_s:.0f}s)", flush=True)
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
    p.add_argument("--combine", metavar="JSON[,JSON...]",
                   help="merge the JSONs of one sweep (rows split over calls) into --results-dir/quality.json and .png")
    p.add_argument("--section", action="append", default=[], metavar="NAME=JSON[,JSON...]",
                   help="with --combine: another sweep (e.g. cpu_sweep), kept under NAME, with its own plot panel")
    p.add_argument("--note", action="append", default=[], help="a note for the combined JSON (repeatable)")
    p.add_argument("--engine", default="stacked", help="the simulator's engine: stacked (default) or threads")
    p.add_argument("--lane-dir", help="where the lanes write their JSONs and logs (default: the partial/results dir)")
    p.add_argument("--lane-deadline-s", type=float,
                   help="stop lanes still running this long after they started, and merge the rows they finished")
    p.add_argument("--warm-start-steps", type=int, default=0,
                   help="first train one model for N steps at DDP's global batch; every row continues from it")
    p.add_argument("--warm-dir", default="/tmp/murmur-quality",
                   help="where the warm start (weights and AdamW state) is saved")
    p.add_argument("--init-from", help="start every row from this checkpoint (a warm start made earlier)")
    p.add_argument("--warm-info", help=argparse.SUPPRESS)  # the lanes' parent tells them how it warmed up
    p.add_argument("--lanes", help="run the rows in parallel processes, one per entry, on these CUDA devices "
                   "(e.g. 0,0,1,1: two on each of two GPUs); needs --steps; the lanes' JSONs are merged")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    for item in args.set:
        key, raw = item.split("=", 1)
        section, name = key.split(".")
        try:
            BASE[section][name] = json.loads(raw)
        except json.JSONDecodeError:
            BASE[section][name] = raw  # a bare word is a string
    if args.lanes:
        return run_lanes(args, argv if argv is not None else sys.argv[1:])
    if args.combine:
        sections = {}
        for item in args.section:
            name, sep, paths = item.partition("=")
            if not sep or not paths:
                p.error(f"--section wants NAME=JSON[,JSON...], got {item!r}")
            sections[name] = [Path(x) for x in paths.split(",")]
        combine([Path(x) for x in args.combine.split(",")], sections, Path(args.results_dir), args.note)
        return 0
    names = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"error: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    dataset = Dataset.open(args.data)
    warm = json.loads(args.warm_info) if args.warm_info else None
    init_path = args.init_from
    if args.warm_start_steps and not init_path:
        init_path = Path(args.warm_dir) / "warm.pt"
        warm = warm_start(args.data, args.warm_start_steps, args.workers * BASE["train"]["batch_size"], device,
                          init_path)
    init = read_warm_start(init_path) if init_path else None
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
        r = run_sim(cfg, args.workers, device, dataset, engine=args.engine, init=init,
                    log=lambda s: print(s, flush=True))
        results.append(r)
        done.append(name)
        rows = rows_of(results, done)
        payload = {
            "device": device_name(device),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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
        if warm:
            payload["warm_start"] = warm
        write(out_paths, payload, results, done)
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(payload.get("summary"), indent=1))
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
