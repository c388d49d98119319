"""How fast the simulator's stacked engine trains: tokens/s and MFU of K replicas in one process.

Issue 18 asks for the stacked engine at >= 30% MFU on one H200 for the quality benchmark's 30M
model at >= 8k tokens per worker-step, so that a row of tens of millions of tokens takes minutes.
This times `StackedReplicas.step` (node/sim/stacked.py), the step `murmur sim` and
benchmarks/quality.py run, for the quality regime's model (benchmarks/quality.py FULL) with K=4,
eager and through torch.compile (MURMUR_COMPILE, `murmur sim --compile`), at several per-worker
batches. The sync is DiLoCo with H past the timed window (the inner step alone), plus one row with
an int4 sync every 25 steps inside the window (what a row's outer steps add).

MFU: the model's training FLOPs per token (6N plus attention, protocol/model_shape.py) times the
tokens/s, against the measured bf16 matrix rate of the device (790 TFLOP/s on an H200).

    source benchmarks/gpu_env.sh && python3 benchmarks/sim_throughput.py --data data/quality-gpt2 \\
        --out $OUT --commit <sha>
    python3 benchmarks/sim_throughput.py --smoke          # the CPU check (tiny model, seconds)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import FULL, SMOKE, commit, device_name  # noqa: E402  (the regimes this benchmark times)
from train_throughput import MEASURED_TFLOPS  # noqa: E402

from murmur.node.model.data import Dataset  # noqa: E402
from murmur.node.sim.replicas import peer_names, worker_loaders  # noqa: E402
from murmur.node.sim.stacked import StackedReplicas  # noqa: E402
from murmur.node.train.build import resolve_device  # noqa: E402
from murmur.protocol.runconfig import config_from_dict  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def measure(regime: dict, data: str, ds: Dataset, device: torch.device, k: int, batch: int, compiled: bool,
            sync: dict, warmup: int, steps: int) -> dict:
    os.environ["MURMUR_COMPILE"] = "on" if compiled else "off"
    d = copy.deepcopy(regime["base"])
    d["data"]["path"] = data
    d["train"]["batch_size"] = batch
    total = warmup + steps
    d["train"]["steps"] = total
    d["sync"].update(sync)
    cfg = config_from_dict(d)
    torch.manual_seed(0)
    reps = StackedReplicas(cfg, k, device, worker_loaders(ds, batch, regime["base"]["model"]["seq_len"]), ds.vocab_size,
                           peer_names(k))
    cuda = device.type == "cuda"
    try:
        t_warm = time.perf_counter()
        for s in range(warmup):
            reps.step(s, total)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t_warm = time.perf_counter() - t_warm
        per_step = []
        t0 = time.perf_counter()
        for s in range(warmup, total):
            h0 = time.perf_counter()
            loss = reps.step(s, total)
            per_step.append(time.perf_counter() - h0)
        final = float(loss[0])  # waits for the device
        seconds = time.perf_counter() - t0
        mcfg = reps.model.cfg
        tokens_per_s = steps * k * batch * mcfg.seq_len / seconds
        name = device_name(device)
        peak = MEASURED_TFLOPS.get(name)
        return {
            "workers": k, "per_worker_batch": batch, "per_worker_batch_tokens": batch * mcfg.seq_len,
            "compile": compiled, "engine": reps.engine,
            "sync": sync, "steps": steps, "params_m": round(mcfg.num_params() / 1e6, 1),
            "tokens_per_s": round(tokens_per_s, 1), "tokens_per_s_per_worker": round(tokens_per_s / k, 1),
            "ms_per_step": round(1000 * seconds / steps, 2),
            "host_ms_per_step_median": round(1000 * statistics.median(per_step), 2),
            "mfu": round(mcfg.flops_per_token() * tokens_per_s / (peak * 1e12), 4) if peak else None,
            "peak_mem_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if cuda else None,
            "warmup_s": round(t_warm, 1), "final_loss": round(final, 4), "device": name,
        }
    finally:
        reps.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the benchmark runs")
    p.add_argument("--data", help="dataset (default data/quality-gpt2; --smoke: data/shakespeare-byte)")
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, help="K (default: the quality regime's)")
    p.add_argument("--batches", help="per-worker batches in sequences, comma-separated (default 8,32,128)")
    p.add_argument("--compile", default="off,on", help="off, on or off,on (default both)")
    p.add_argument("--steps", type=int, help="timed steps (default 30; smoke 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 8; smoke 1)")
    p.add_argument("--commit", help="the commit measured (where the tree has no .git)")
    p.add_argument("--out", help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--results-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    regime = SMOKE if args.smoke else FULL
    data = args.data or ("data/shakespeare-byte" if args.smoke else "data/quality-gpt2")
    device = resolve_device("cpu" if args.smoke and args.device == "auto" else args.device)
    k = args.workers or regime["workers"]
    batches = [int(b) for b in (args.batches or ("2" if args.smoke else "8,32,128")).split(",")]
    modes = [m == "on" for m in args.compile.split(",")]
    steps, warmup = args.steps or (2 if args.smoke else 30), args.warmup or (1 if args.smoke else 8)
    long_h = {"algorithm": "diloco", "inner_steps": 10 ** 6, "codec": "fp32"}
    plan = [(b, c, long_h) for c in modes for b in batches]
    h = 2 if args.smoke else 25  # a sync inside the timed window (steps warmup..warmup+steps)
    plan += [(batches[min(1, len(batches) - 1)], c, {"algorithm": "diloco", "inner_steps": h, "codec": "int4"})
             for c in modes]
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    payload = {
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python3 benchmarks/sim_throughput.py {argv_text}", "commit": args.commit or commit(),
        "model": regime["base"]["model"], "torch": torch.__version__,
        "note": "tokens_per_s counts all K workers; mfu against the measured bf16 matrix rate",
        "rows": [],
    }
    dirs = [Path(args.results_dir)] + ([Path(args.out)] if args.out else [])
    ds = Dataset.open(data)
    for batch, compiled, sync in plan:
        try:
            row = measure(regime, data, ds, device, k, batch, compiled, sync, warmup, steps)
        except Exception as err:  # noqa: BLE001 - a row that fails (out of memory, a compile error) is a result
            row = {"workers": k, "per_worker_batch": batch, "compile": compiled, "sync": sync,
                   "error": f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        payload["rows"].append(row)
        print(json.dumps(row), flush=True)
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "sim_throughput.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
