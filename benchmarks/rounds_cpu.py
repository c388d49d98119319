"""Does DiLoCo's gap to DDP shrink with more outer rounds at a volunteer's batch? On the CPU.

Every 32k row on the GPU (benchmarks/results/quality.json) runs 1000 inner steps: 20 outer rounds
at H=50, 4 at H=250. Neither of issue 39's targets is met there, and running longer on the GPU
would repeat its 30M-token corpus (13 passes at 3000 steps, where DDP overfits:
repetition_32k_2026_12_06). This runs the same two rows as warm_lr_cpu.py (DDP, and DiLoCo int4
with outer lr 1 + Nesterov 0.5 at H=15, both at 2x optim.lr) five times as long, 100 rounds, from a
warm start trained at the rows' lr (no lr jump), and reports the gap at every tenth round
(``gap_by_rounds``). The lr is constant after warm-up, so the point after R rounds is what a run of
R rounds reaches. sparseloco_cpu.py's model and corpus: a byte-level 2-layer model (0.5M
parameters) on the bundled Shakespeare, K=4, 8k tokens per worker-step, one seed. Too small a model
to overfit 5.2M bytes in 9 passes (DDP's curve says whether it did): it says whether more rounds
close the gap at this batch, not by how much a volunteer run would gain.

    python3 benchmarks/rounds_cpu.py            # ~45 min on 2 cores (two rows at once)

JSON (benchmarks/results/rounds_cpu.json): device, date, command, commit, regime, the warm start,
the rows (as quality.py's, with loss_gap_pct against DDP), their curves and gap_by_rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the warm start, gaps and JSON writing)
import sparseloco_cpu as cpu  # noqa: E402  (the CPU model, corpus, one-row runner and gap_by_rounds)
import warm_lr_cpu  # noqa: E402  (the two rows, at the same lr)

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/shakespeare-byte")
    p.add_argument("--steps", type=int, default=100 * cpu.H, help="inner steps per row (default 1500: 100 rounds)")
    p.add_argument("--warm-start-steps", type=int, default=300)
    p.add_argument("--batch-rows", type=int, default=64, help="rows of 128 tokens per worker-step (default 64: 8k)")
    p.add_argument("--jobs", type=int, default=2, help="rows run at once, one core each")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--warm-dir", default="/tmp/murmur-rounds-cpu", help="where the warm start is saved")
    args = p.parse_args(argv)
    if args.steps < cpu.H:
        print(f"error: --steps must be at least one round ({cpu.H}), got {args.steps}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.jobs)
    regime = warm_lr_cpu.rows_regime(args.batch_rows)
    payload = warm_lr_cpu.run_header("rounds_cpu.py", argv, args, regime)
    payload["regime"]["rounds"] = args.steps // cpu.H
    payload.update(rows=[], curves={})
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    init_path = Path(args.warm_dir) / f"warm-x{warm_lr_cpu.ROWS_LR:g}.pt"
    # At the rows' lr: no row starts with a jump (warm_lr_cpu.json: a 2x jump costs DiLoCo 0.75 points).
    payload["warm_start"] = quality.warm_start(cpu.REGIME, args.data, args.warm_start_steps, torch.device("cpu"),
                                               init_path, warm_lr_cpu.ROWS_LR)
    print(f"warm start: {json.dumps(payload['warm_start'])}", flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        def save() -> None:
            payload["gap_by_rounds"] = cpu.gap_by_rounds(payload["rows"], payload["curves"])
            payload["seconds"] = round(time.perf_counter() - t0, 1)
            quality.write_json(out_dir / "rounds_cpu.json", payload)

        warm_lr_cpu.run_rows(pool, regime, args, init_path, payload, save)
    print(json.dumps(payload["gap_by_rounds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
