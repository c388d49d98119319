"""MuLoCo on the CPU proxy: does Muon as DiLoCo's inner optimizer close the gap to the best data parallel?

The model and regime where DiLoCo-AdamW int4's gap is already measured (sparseloco_cpu.py,
rounds_cpu.py: 3.4-4.7% behind DDP over 10-100 rounds): a byte-level 2-layer model (0.5M
parameters) on the bundled Shakespeare, K = 4 workers, 8k tokens per worker-step (64 x 128), a
constant lr after warm-up, all rows from one warm start trained at the rows' AdamW lr (2x optim.lr,
no lr jump: warm_lr_cpu.json). Rows:

- the data-parallel baselines, each with its lr swept until the winner sits inside its bracket:
  AdamW DDP (optim.lr) and Muon DDP (optim.muon_lr; AdamW at 2x for the embedding, head and norms);
- DiLoCo-AdamW int4 as today (outer lr 1, Nesterov 0.5, no error feedback) at H 15, 30, 60;
- MuLoCo (Muon inside, same outer step) with int4 and 2-bit deltas, both with error feedback, at
  H 15, 30, 60, Muon's inner lr swept over --muloco-sweep: multiples of Muon DDP's winning lr, read
  from the --resume JSON of a call that ran the DP rows (so run those first).

Every setting runs --seeds seeds (two by default). ``loss_gap_pct`` is against the best DP row (the
lower of AdamW DDP and Muon DDP), and the summary names the row sending least within 3%, 2% and
1.5% of it (the target: >= 250x less traffic within 1.5%).

Rows x variants run as separate processes, --jobs at once, each with its own thread count; on a
GPU they share it (the model is tiny: many processes keep it busy). Imports only torch and the
simulator (no hivemind, no gRPC): the GPU machine runs it with pydantic carried as wheels.

    # here (2 cores): a smoke run, seconds a row
    nice python3 benchmarks/muloco_cpu.py --steps 60 --seeds 1 --jobs 2 --results-dir /tmp/muloco-smoke
    # the full grid (a GPU machine: 16 cores and one GPU); rows already in --resume's JSON are kept
    source benchmarks/gpu_env.sh && python3 benchmarks/muloco_cpu.py --device cuda --jobs 12 --threads 1

JSON (benchmarks/results/muloco_cpu.json): device, date, command, commit, regime, warm_start, rows
(quality.py's fields plus inner, algorithm, error_feedback, variants), curves, summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (rows, row runner, warm start, JSON writing)
import sparseloco_cpu as cpu  # noqa: E402  (the CPU model and corpus)
import warm_lr_cpu  # noqa: E402  (the regime at a batch, the JSON's head)

from murmur.node.model.data import Dataset  # noqa: E402
from murmur.node.sim.replicas import read_warm_start  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HS = (15, 30, 60)
ROWS_LR = warm_lr_cpu.ROWS_LR  # AdamW's lr in every row but the swept ones: 2x optim.lr (DDP's best here)
DP_SWEEP = (1.0, 2.0, 4.0)  # the DP rows' first bracket; extended while the winner is at an edge
MAX_EXTEND = 3  # lr steps (x2 or /2) a DP sweep may add beyond its bracket
# MuLoCo's Muon lr, as multiples of Muon DDP's winning lr when a --resume JSON has that row (run the
# DP rows first), else of optim.lr. Muon's best lr is far from AdamW's: the CPU smoke run's Muon DDP
# won at 16x optim.lr (60 steps).
MULOCO_SWEEP = (0.5, 1.0, 2.0)
DILOCO = {"algorithm": "diloco", **quality.OUTER1_N05}


def build_rows(
    hs=HS, muloco_sweep=MULOCO_SWEEP, muloco_lr: float | None = None
) -> list[tuple[quality.Row, str | None]]:
    """(row, the optim key its variants sweep, or None when the row is not swept for a bracket).
    ``muloco_lr``: the Muon lr MuLoCo's sweep multiplies (default optim.lr)."""
    base_lr = cpu.REGIME["base"]["optim"]["lr"]
    adamw_at = {"lr": base_lr * ROWS_LR}
    muon = {"inner": "muon", "lr": base_lr * ROWS_LR, "muon_lr": base_lr}
    muloco = {**muon, "muon_lr": muloco_lr or base_lr}
    rows: list[tuple[quality.Row, str | None]] = [
        (quality.Row("adamw-ddp", {"algorithm": "ddp", "inner_steps": hs[0]},
                     variants=[{"optim.lr": m} for m in DP_SWEEP]), "optim.lr"),
        (quality.Row("muon-ddp", {"algorithm": "ddp", "inner_steps": hs[0]}, optim=muon,
                     variants=[{"optim.muon_lr": m} for m in DP_SWEEP]), "optim.muon_lr"),
    ]
    for h in hs:
        rows.append((quality.Row(f"diloco-adamw-int4-H{h}", {**DILOCO, "inner_steps": h, "codec": "int4"},
                                 optim=adamw_at), None))
    for codec in ("int4", "2bit"):
        for h in hs:
            rows.append((quality.Row(f"muloco-{codec}-ef-H{h}",
                                     {**DILOCO, "inner_steps": h, "codec": codec, "error_feedback": "on"},
                                     optim=muloco, variants=[{"optim.muon_lr": m} for m in muloco_sweep]), None))
    return rows


def run_unit(regime: dict, row: quality.Row, variant: dict, data: str, steps: int, seeds: list[int],
             init_path: str, device: str, threads: int) -> tuple[dict, list]:
    """One row at one variant over the seeds, in its own process."""
    torch.set_num_threads(threads)
    os.environ.setdefault("MURMUR_COMPILE", "off")  # seconds of compile per process for a tiny model
    one = quality.Row(row.name, row.sync, row.optim, [variant], row.workers)
    out, curve, _ = quality.run_row(regime, one, data, steps, seeds, torch.device(device), Dataset.open(data),
                                    read_warm_start(init_path), lambda s: None)
    return out, curve


def describe(row: quality.Row, out: dict, init_sha256: str) -> dict:
    """quality.py's row with the fields this benchmark compares by."""
    sync = row.sync
    ef = sync.get("error_feedback", "auto")
    if ef == "auto":  # the codec's own default (optim/codecs.py)
        ef = "on" if out["codec"] in ("2bit", "sign", "topk", "topk2bit", "powersgd") else "off"
    extra = {}
    if row.optim.get("inner") == "muon":  # Muon's peak lr at the best variant (inner_lr is AdamW's)
        best = min(out["variants"], key=lambda v: v["val_loss_mean"])["variant"]
        extra["muon_lr"] = row.optim["muon_lr"] * best.get("optim.muon_lr", 1.0)
    return {**out, "inner": row.optim.get("inner", "adamw"), "algorithm": sync["algorithm"],
            "error_feedback": ef if sync["algorithm"] != "ddp" else None, "init_sha256": init_sha256, **extra}


def merge_variants(parts: list[tuple[dict, list]]) -> tuple[dict, list]:
    """One row from its variants' runs: the best variant's, with every variant listed."""
    best_out, best_curve = min(parts, key=lambda p: p[0]["val_loss_mean"])
    tried = [v for out, _ in parts for v in out["variants"]]
    return {**best_out, "variants": tried, "seconds": round(sum(o["seconds"] for o, _ in parts), 1)}, best_curve


def next_variant(tried: list[float], best: float) -> float | None:
    """The lr multiple beyond the bracket's edge when the best one sits on it, else None."""
    if best == max(tried):
        return best * 2
    if best == min(tried):
        return best / 2
    return None


def add_gaps(rows: list[dict]) -> None:
    """Each row's gap (%) to the best DP row (the lowest loss among the DDP rows)."""
    dp = [r for r in rows if r["algorithm"] == "ddp"]
    if not dp:
        return
    best = min(r["val_loss_mean"] for r in dp)
    for r in rows:
        r["loss_gap_pct"] = round(100 * (r["val_loss_mean"] - best) / best, 2)
        r["best_dp"] = min(dp, key=lambda x: x["val_loss_mean"])["name"]


def summarize(rows: list[dict]) -> dict:
    def brief(r):
        return r and {k: r[k] for k in ("name", "reduction_vs_ddp", "loss_gap_pct")}

    low = [r for r in rows if r["algorithm"] != "ddp" and r.get("loss_gap_pct") is not None and r["reduction_vs_ddp"]]
    dp = [r for r in rows if r["algorithm"] == "ddp"]
    out = {"best_dp": brief(min(dp, key=lambda r: r["val_loss_mean"], default=None))}
    for pct in (3, 2, 1.5):
        out[f"best_within_{pct:g}pct"] = brief(quality.best_within(low, pct))
    out["smallest_gap_at_250x"] = brief(quality.smallest_gap_at(low, 250))
    hit = [r for r in low if r["reduction_vs_ddp"] >= 250 and r["loss_gap_pct"] <= 1.5]
    out["target_250x_within_1.5pct"] = bool(hit)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/shakespeare-byte")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=600, help="inner steps per row after the warm start (default 600: "
                                                          "40 rounds at H15, 10 at H60); a multiple of every H")
    p.add_argument("--warm-start-steps", type=int, default=300)
    p.add_argument("--batch-rows", type=int, default=64, help="rows of 128 tokens per worker-step (default 64: 8k)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--hs", default=",".join(str(h) for h in HS), help="the H values of the DiLoCo/MuLoCo rows")
    p.add_argument("--muloco-sweep", default=",".join(f"{m:g}" for m in MULOCO_SWEEP),
                   help="MuLoCo's Muon lr: multiples of Muon DDP's winning lr from --resume's JSON, else of "
                        "optim.lr (default 0.5,1,2)")
    p.add_argument("--rows", help="comma-separated subset of the rows (default all)")
    p.add_argument("--jobs", type=int, default=2, help="row variants run at once, each in its own process")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--resume", help="a muloco_cpu.json of an earlier call: its rows are kept, not run again")
    p.add_argument("--commit", help="the commit measured, where the tree has no .git (the GPU machine)")
    p.add_argument("--warm-dir", default="/tmp/murmur-muloco-cpu", help="where the warm start is saved")
    args = p.parse_args(argv)
    try:
        hs = tuple(int(x) for x in args.hs.split(","))
        muloco_sweep = tuple(float(x) for x in args.muloco_sweep.split(","))
    except ValueError:
        print("error: --hs and --muloco-sweep are comma-separated numbers", file=sys.stderr)
        return 2
    bad = [h for h in hs if h < 1 or args.steps % h]
    if bad:
        print(f"error: --steps {args.steps} must be a positive multiple of every H (not of {bad})", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible: use --device cpu", file=sys.stderr)
        return 2
    old = json.loads(Path(args.resume).read_text()) if args.resume else {}
    muon_dp = next((r for r in old.get("rows", []) if r["name"] == "muon-ddp"), None)
    muloco_lr = muon_dp["muon_lr"] if muon_dp else None
    rows = build_rows(hs, muloco_sweep, muloco_lr)
    if args.rows:
        names = args.rows.split(",")
        unknown = [n for n in names if n not in {r.name for r, _ in rows}]
        if unknown:
            print(f"error: unknown rows {unknown}; known: {', '.join(r.name for r, _ in rows)}", file=sys.stderr)
            return 2
        rows = [(r, k) for r, k in rows if r.name in names]
    if muloco_lr is None and any(r.optim.get("inner") == "muon" and r.sync["algorithm"] != "ddp" for r, _ in rows):
        print("note: no Muon DDP row in a --resume JSON: MuLoCo's lr sweep multiplies optim.lr", flush=True)
    torch.set_num_threads(args.threads)
    regime = warm_lr_cpu.rows_regime(args.batch_rows)
    seeds = list(range(args.seeds))
    payload = warm_lr_cpu.run_header("muloco_cpu.py", argv, args, regime)
    payload["device"] = (quality.device_name(torch.device(args.device)) +
                         f", {args.jobs} processes at once, {args.threads} threads each")
    payload["commit"] = args.commit or payload["commit"]
    payload["regime"].update(H=list(hs), seeds=seeds, dp_sweep=list(DP_SWEEP), muloco_sweep=list(muloco_sweep),
                             muloco_sweep_of=(f"Muon DDP's winner, muon_lr {muloco_lr:g}" if muloco_lr else
                                              f"optim.lr {cpu.REGIME['base']['optim']['lr']:g}"),
                             outer=quality.describe_outer(quality.config_from_dict(
                                 {"sync": {**DILOCO, "inner_steps": hs[0]}}).sync))
    payload.update(rows=[], curves={}, summary={})
    kept: dict[str, dict] = {}
    if args.resume:
        kept = {r["name"]: r for r in old.get("rows", [])}
        payload["rows"] = [r for r in old.get("rows", []) if r["name"] in {row.name for row, _ in rows}]
        names = {r["name"] for r in payload["rows"]}
        payload["curves"] = {n: c for n, c in old.get("curves", {}).items() if n in names}
        payload["resumed_from"] = old.get("command")
        payload["resumed_warm_start"] = old.get("warm_start")
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    init_path = Path(args.warm_dir) / f"warm-{args.device}-x{ROWS_LR:g}-{args.warm_start_steps}.pt"
    resumed_warm = payload.pop("resumed_warm_start", None)
    if not init_path.is_file():  # one warm start per machine and length: rows of several calls share it
        payload["warm_start"] = quality.warm_start(cpu.REGIME, args.data, args.warm_start_steps,
                                                   torch.device(args.device), init_path, ROWS_LR)
    else:  # an earlier call's: its record if --resume has it
        payload["warm_start"] = resumed_warm or {"reused": str(init_path)}
    payload["init"] = {"path": str(init_path), "sha256": quality.sha256(init_path)}
    print(f"warm start: {json.dumps(payload['warm_start'])}", flush=True)

    def save() -> None:
        add_gaps(payload["rows"])
        payload["summary"] = summarize(payload["rows"])
        payload["seconds"] = round(time.perf_counter() - t0, 1)
        quality.write_json(out_dir / "muloco_cpu.json", payload)

    ctx = torch.multiprocessing.get_context("spawn")
    todo = [(r, k) for r, k in rows if r.name not in kept]
    with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        parts: dict[str, list] = {r.name: [] for r, _ in todo}
        waiting: dict[futures.Future, tuple[quality.Row, str | None]] = {}
        extended: dict[str, int] = {}

        def submit(row: quality.Row, key: str | None, variant: dict) -> None:
            fut = pool.submit(run_unit, regime, row, variant, args.data, args.steps, seeds, str(init_path),
                              args.device, args.threads)
            waiting[fut] = (row, key)

        for row, key in todo:
            for v in row.variants:
                submit(row, key, v)
        while waiting:
            done, _ = futures.wait(waiting, return_when=futures.FIRST_COMPLETED)
            for fut in done:
                row, key = waiting.pop(fut)
                parts[row.name].append(fut.result())
                if any(w[0].name == row.name for w in waiting.values()):
                    continue  # the row's other variants are still running
                out, curve = merge_variants(parts[row.name])
                if key is not None:  # a DP row: its winner must sit inside the bracket
                    tried = [v["variant"][key] for v in out["variants"]]
                    best = min(out["variants"], key=lambda v: v["val_loss_mean"])["variant"][key]
                    beyond = next_variant(tried, best)
                    if beyond is not None and extended.get(row.name, 0) < MAX_EXTEND:
                        extended[row.name] = extended.get(row.name, 0) + 1
                        print(f"{row.name}: best at the bracket's edge, adding {key} x{beyond:g}", flush=True)
                        submit(row, key, {key: beyond})
                        continue
                    out["bracketed"] = beyond is None
                row_out = describe(row, out, payload["init"]["sha256"])
                payload["rows"] = [r for r in payload["rows"] if r["name"] != row.name] + [row_out]
                payload["curves"][row.name] = curve
                save()
                print(json.dumps({k: v for k, v in row_out.items() if k not in ("variants", "val_losses")}), flush=True)
    save()
    print(json.dumps(payload["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
