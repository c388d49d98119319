"""Benchmark: the CPU a pipeline spends per sample besides the stages' compute, in one process.

    nice .venv/bin/python benchmarks/pipeline_hop_cpu.py [--microbatches 300] [--concurrency 4] \
        [--label new] [--out benchmarks/results/pipeline_hop_cpu.json]

benchmarks/pipeline.py measures efficiency with five processes on two shared cores, so its figure
moves with whatever else the machine runs. This one isolates what the pipeline's own code costs
per sample: two real stage services (gRPC, mutual TLS, loopback) and a real driver (router,
client, codecs, `run_in_order`) in one process, the same model and shape as benchmarks/pipeline.py
(the tiny preset, 4 blocks, dim 128, seq 128, 2 stages, microbatches of 4 rows, bf16 activations,
16 samples a step). The process's CPU time over the measured microbatches, minus the CPU of the
stages' compute threads (forward, backward, accumulation, optimizer steps: `WorkerStats.cpu_seconds`),
is the overhead: serialization, codecs and their checks, gRPC and TLS on both ends, the event loop,
the garbage collector. CPU time, not wall time: another job on the cores does not inflate it much
(a busy machine's caches still do: compare runs taken beside each other). As a stage peer or a
driver does once ready (node/pipeline/memory.py), the start-up heap is frozen before measuring.

Each run appends a row (label, commit, load, CPU ms per sample: compute, overhead, all) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.pipeline import memory
from murmur.node.pipeline.client import StageClient, StageEndpoint
from murmur.node.pipeline.config import pipeline_model_config
from murmur.node.pipeline.driver import Driver, run_in_order
from murmur.node.pipeline.router import Router
from murmur.node.pipeline.service import StageService, StageServiceSettings
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.identity import CertificateAuthority
from murmur.protocol.runconfig import OptimSection, PipelineSection

HERE = Path(__file__).resolve().parent
ROWS, STAGES, TARGET = 4, 2, 16


async def run(args) -> dict:
    cfg = pipeline_model_config("tiny", STAGES, n_layers=4, dim=128, seq_len=128)
    ca = CertificateAuthority.create("hop-cpu")
    optim = OptimSection(lr=1e-3, warmup_steps=0, grad_clip=1.0)
    services = []
    for span in split_layers(cfg.n_layers, STAGES):
        worker = StageWorker(build_stage(cfg, 0, span), optim, target_samples=TARGET, grad_clip=1.0)
        svc = StageService(ca.issue(), worker, run_id="bench", settings=StageServiceSettings(max_rows=ROWS))
        await svc.start()
        services.append(svc)
    pipe = PipelineSection(stages=STAGES, microbatch_size=ROWS, activation_codec=args.codec, hop_timeout_s=60.0)
    client = StageClient(ca.issue(), run_id="bench")
    router = Router(pipe)
    for svc in services:
        router.set_peers(svc.span.index, [StageEndpoint(svc.identity.node_id, svc.address, svc.span.index)])
    driver = Driver(client, router, pipe, dim=cfg.dim)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (64, ROWS, cfg.seq_len + 1), generator=g)

    def batch(i: int):
        seq = data[i % len(data)]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    async def drive(start: int, count: int) -> None:
        await run_in_order(driver, batch, count, concurrency=args.concurrency, on_done=lambda i, r: None,
                           on_commit=lambda lo, hi: None, start=start)

    try:
        await drive(0, args.warmup)
        if hasattr(memory, "freeze_startup_heap"):  # what a stage peer and a driver do once ready
            memory.freeze_startup_heap()
        else:
            gc.collect()
        compute0 = sum(s.worker.stats.cpu_seconds for s in services)
        cpu0, t0 = time.process_time(), time.monotonic()
        await drive(args.warmup, args.microbatches)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        compute = sum(s.worker.stats.cpu_seconds for s in services) - compute0
    finally:
        await client.aclose()
        for svc in services:
            await svc.stop()
    samples = args.microbatches * ROWS
    return {
        "label": args.label, "microbatches": args.microbatches, "concurrency": args.concurrency,
        "codec": args.codec, "cpu_ms_per_sample": {
            "compute": round(1000 * compute / samples, 3), "overhead": round(1000 * (cpu - compute) / samples, 3),
            "all": round(1000 * cpu / samples, 3)},
        "wall_s": round(wall, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--codec", default="bf16")
    ap.add_argument("--label", default="", help="what code this is (e.g. the commit before a change)")
    ap.add_argument("--out", default=str(HERE / "results" / "pipeline_hop_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    row = asyncio.run(run(args))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                            text=True).stdout.strip()
    row.update(commit=commit, date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               load=[round(x, 2) for x in load0] + [round(x, 2) for x in os.getloadavg()][:1])
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {
        "benchmark": "pipeline_hop_cpu", "device": f"CPU: {platform.machine()}, {os.cpu_count()} cores (shared)",
        "command": "benchmarks/pipeline_hop_cpu.py " + " ".join(sys.argv[1:]),
        "load": "the load averages at the start (1, 5, 15 min) and the 1-min one at the end", "rows": []}
    result["rows"].append(row)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
