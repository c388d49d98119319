"""Does a row that starts with an lr jump lose more to DDP under DiLoCo? The warm start's lr, on the CPU.

quality.py's warm start trains at 1x optim.lr and the 32k rows at 4x (DDP's best), so every row
begins by warming up to 4x the lr its weights were trained at. On the GPU (benchmarks/results/
quality.json, sections regime_32k*) DiLoCo with outer Nesterov 0.5 loses loss over its first 100
steps while DDP gains. This measures whether that jump costs DiLoCo part of its final gap: the same
rows (DDP, and DiLoCo int4 with outer lr 1 + Nesterov 0.5 at H=15), both at 2x optim.lr (DDP's best
of 1x/2x at this batch in sparseloco_cpu.json), continue from a warm start trained at 1x (a 2x jump)
and from one trained at 2x (no jump). sparseloco_cpu.py's model and corpus: a byte-level 2-layer
model (0.5M parameters) on the bundled Shakespeare, K=4, 8k tokens per worker-step, 300 steps (20
rounds), a constant lr after 20 warm-up steps, one seed. It is not the GPU regime: it says whether
the mechanism matters, not by how much a volunteer run would gain.

    python3 benchmarks/warm_lr_cpu.py            # ~20 min on 2 cores (two rows at once)

JSON (benchmarks/results/warm_lr_cpu.json): device, date, command, commit, regime, and per warm
start: its lr and loss, the rows (as quality.py's, with loss_gap_pct against that warm start's DDP)
and their curves.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the rows, the warm start and the row runner)
import sparseloco_cpu as cpu  # noqa: E402  (the CPU model, corpus and one-row runner)

RESULTS = Path(__file__).resolve().parent / "results"
ROWS_LR = 2.0  # the rows' lr, as a multiple of optim.lr
ROWS = [
    quality.Row("ddp", {"algorithm": "ddp", "inner_steps": cpu.H}, variants=quality.lr_variants((ROWS_LR,))),
    quality.Row(f"outer1-nesterov0.5-int4-H{cpu.H}", {"algorithm": "diloco", "inner_steps": cpu.H, "codec": "int4",
                                                      **quality.OUTER1_N05}, variants=quality.lr_variants((ROWS_LR,))),
]


def rows_regime(batch_rows: int) -> dict:
    """sparseloco_cpu.py's regime at this per-worker batch, its validation set the same size."""
    return cpu.section_regime(batch_rows, max(1, cpu.EVAL_SEQUENCES // batch_rows))


def run_header(script: str, argv: list[str] | None, args: argparse.Namespace, regime: dict) -> dict:
    """The head of the JSON that this script and rounds_cpu.py write: the machine, the run, the regime."""
    return {
        "device": quality.device_name(torch.device("cpu")) + f", {args.jobs} rows at once",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python3 benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": quality.commit(),
        "regime": {"workers": regime["workers"], "H": cpu.H, "model": regime["base"]["model"],
                   "optim": regime["base"]["optim"], "rows_lr_mult": ROWS_LR, "seeds": [0],
                   "per_worker_batch_tokens": args.batch_rows * regime["base"]["model"]["seq_len"],
                   "steps": args.steps, "corpus": args.data},
        "curve_columns": ["step", "tokens", "bytes_sent_per_worker", "val_loss"],
    }


def run_rows(pool: futures.Executor, regime: dict, args: argparse.Namespace, init_path: Path, entry: dict,
             save) -> None:
    """ROWS from the warm start at ``init_path``, --jobs at once; as each ends, its row and curve go
    into ``entry``, every row's gap is taken again and ``save()`` writes the JSON."""
    pending = [pool.submit(cpu.run_one, regime, r, args.data, args.steps, str(init_path)) for r in ROWS]
    for done in futures.as_completed(pending):
        out, curve = done.result()
        entry["rows"].append(out)
        entry["curves"][out["name"]] = curve
        quality.add_gaps(entry["rows"])
        save()
        print(json.dumps({k: v for k, v in out.items() if k != "variants"}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/shakespeare-byte")
    p.add_argument("--steps", type=int, default=20 * cpu.H, help="inner steps per row (default 300: 20 rounds)")
    p.add_argument("--warm-start-steps", type=int, default=300)
    p.add_argument("--batch-rows", type=int, default=64, help="rows of 128 tokens per worker-step (default 64: 8k)")
    p.add_argument("--warm-lrs", default="1,2", help="the warm starts' lrs as multiples of optim.lr (default 1,2)")
    p.add_argument("--jobs", type=int, default=2, help="rows run at once, one core each")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--warm-dir", default="/tmp/murmur-warm-lr-cpu", help="where the warm starts are saved")
    args = p.parse_args(argv)
    try:
        warm_lrs = [float(x) for x in args.warm_lrs.split(",")]
    except ValueError:
        print(f"error: --warm-lrs is a comma-separated list of numbers, got {args.warm_lrs!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.jobs)
    regime = rows_regime(args.batch_rows)
    payload = {**run_header("warm_lr_cpu.py", argv, args, regime), "warm_starts": []}
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        for mult in warm_lrs:
            init_path = Path(args.warm_dir) / f"warm-x{mult:g}.pt"
            # Trained as sparseloco_cpu.py trains its warm start (its base batch x K), at this lr.
            warm = quality.warm_start(cpu.REGIME, args.data, args.warm_start_steps, torch.device("cpu"), init_path,
                                      mult)
            print(f"warm start x{mult:g}: {json.dumps(warm)}", flush=True)
            entry = {"lr_mult": mult, "warm_start": warm, "rows": [], "curves": {}}
            payload["warm_starts"].append(entry)
            def save() -> None:
                payload["seconds"] = round(time.perf_counter() - t0, 1)
                quality.write_json(out_dir / "warm_lr_cpu.json", payload)

            run_rows(pool, regime, args, init_path, entry, save)
    for entry in payload["warm_starts"]:
        print(f"warm x{entry['lr_mult']:g}", json.dumps({r["name"]: r["loss_gap_pct"] for r in entry["rows"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
