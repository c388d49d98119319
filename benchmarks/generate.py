"""How fast `murmur generate` samples, with and without the KV cache.

Batch 1, greedy, a 16-token prompt, --new-tokens new tokens (256) through node/export/generate.py's
`generate`, the loop `murmur generate` runs (without its tokenizer and printing). The weights are
the preset's seeded initial ones: speed does not depend on what the model learned. Past the
model's context (the tiny preset's is 128 tokens) both paths restart it on the last half of the
text (node/export/generate.py), so "no cache" is a full forward of up to seq_len tokens per token.

    .venv/bin/python benchmarks/generate.py [--presets tiny,small] [--device cpu] [--threads 1] [--repeats 5]

Writes benchmarks/results/generate.json: the device, date, command, commit and load average; rows
{preset, seq_len, cache, batch, new_tokens, tokens_per_s (median of the repeats),
tokens_per_s_runs}; speedup per preset (cache over no cache, medians).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from murmur.node.export.generate import Sampling, generate
from murmur.node.model.transformer import Transformer, model_config
from murmur.node.train.build import resolve_device

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "generate.json"
PROMPT_TOKENS = 16


def rate(model: Transformer, new_tokens: int, cache: bool) -> float:
    prompt = list(range(1, PROMPT_TOKENS + 1))
    device = model.embed.weight.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    n = sum(1 for _ in generate(model, prompt, max_new_tokens=new_tokens, sampling=Sampling(temperature=0),
                                use_cache=cache))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert n == new_tokens
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny", help="comma-separated model presets (default tiny)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows, speedup = [], {}
    for preset in args.presets.split(","):
        model = Transformer(model_config(preset), seed=0).to(device=device, dtype=dtype).eval()
        rate(model, 8, True)  # first calls allocate and pick kernels: not part of any row
        rate(model, 8, False)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):  # interleaved, so a drift of the machine's load hits both
            for cache in (True, False):
                runs[cache].append(rate(model, args.new_tokens, cache))
                mode = "KV cache" if cache else "no cache"
                print(f"{preset:6s} {mode:9s} {runs[cache][-1]:10,.1f} tok/s", flush=True)
        for cache, r in runs.items():
            rows.append({
                "preset": preset, "seq_len": model.cfg.seq_len, "cache": cache, "batch": 1,
                "new_tokens": args.new_tokens, "tokens_per_s": round(statistics.median(r), 1),
                "tokens_per_s_runs": [round(x, 1) for x in r],
            })
        speedup[preset] = round(statistics.median(runs[True]) / statistics.median(runs[False]), 2)
        print(f"{preset}: the KV cache is {speedup[preset]:.2f}x faster at {args.new_tokens} new tokens")
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s)"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    commit = commit or os.environ.get("MURMUR_COMMIT", "")  # the GPU machine has no .git
    result = {
        "benchmark": "generate",
        "device": where,
        "dtype": args.dtype,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": ".venv/bin/python " + shlex.join(["benchmarks/generate.py", *sys.argv[1:]]),
        "commit": commit or None,
        "load_average": [round(x, 1) for x in os.getloadavg()],  # the 1, 5, 15 min load when it ended
        "speedup": speedup,
        "rows": rows,
    }
    if device.type != "cuda":
        result["not_run"] = [{
            "preset": "base", "device": "cuda",
            "why": "no GPU in the session that measured this; run with --presets base --device cuda --dtype bf16",
        }]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
