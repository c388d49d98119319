"""What a stage peer holds: its parameters and its peak resident memory, stage by stage, against
the whole model; and one microbatch through every stage, streamed where it is above the cap.

One stage peer process per stage (python -m murmur.node.pipeline.stage_peer_process, identities
of one CA, no coordinator), started one after another so that each measures its own memory; one
microbatch of --rows rows of full sequence length goes forward through the stages and backward
again (real gRPC on loopback, the --codec on the wire, chunk streams for any payload above
--message-cap-mb), every stage steps its AdamW once, then the peers stop and report their peak
RSS. A last process builds the whole `Transformer` of the same config, as every stage peer did
before a stage held only its stage, and reports what that cost.

    .venv/bin/python benchmarks/stage_memory.py [--preset base] [--stages 4] [--rows 4] [--codec fp32]

Writes benchmarks/results/stage_memory.json: top level the model (params_total, whole_param_mb,
full_state_mb: weights, gradients and AdamW moments of the whole model in fp32) and
whole_build_rss_mb (the RSS growth of building the whole model); rows {stage, blocks,
stage_param_mb, build_rss_mb (peak RSS growth once its stage is built), step_rss_mb (peak RSS
growth after one microbatch and an optimizer step), start_rss_mb, streamed (calls to it that went
as chunk streams)}. RSS growth is over the process's RSS at start, torch and gRPC imported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from murmur.node.model.stages import split_layers
from murmur.node.net.loop import LoopThread
from murmur.node.pipeline.client import StageClient, StageEndpoint
from murmur.node.pipeline.config import pipeline_model_config
from murmur.protocol.identity import CertificateAuthority

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "stage_memory.json"
MIB = 1 << 20
RUN = "stage-memory"

WHOLE = """
import json, sys
from murmur.node.pipeline.memory import peak_rss_mb, rss_mb
from murmur.node.pipeline.config import pipeline_model_config
from murmur.node.model.transformer import Transformer
start = rss_mb()
model = Transformer(pipeline_model_config(sys.argv[1], int(sys.argv[2])), seed=0)
print(json.dumps({"whole_build_rss_mb": round(peak_rss_mb() - start, 1)}))
"""


def start_peer(folder: Path, ca: CertificateAuthority, stage: int, args) -> tuple[subprocess.Popen, dict]:
    ca.issue().save(folder)
    proc = subprocess.Popen(
        [sys.executable, "-m", "murmur.node.pipeline.stage_peer_process", "--identity", str(folder), "--run", RUN,
         "--stage", str(stage), "--stages", str(args.stages), "--preset", args.preset, "--target-samples",
         str(args.rows), "--max-rows", str(args.rows), "--message-cap-mb", str(args.message_cap_mb),
         "--threads", str(args.threads), "--progress-every", "0"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"stage peer {stage} exited before it was ready (rc {proc.wait()})")
    return proc, json.loads(line)


async def one_microbatch(client: StageClient, peers: list[StageEndpoint], args, cfg) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.rows, cfg.seq_len), generator=g)
    inputs = [x]
    for peer in peers[:-1]:
        h, _ = await client.forward(peer, "mb0", inputs[-1], reply_codec=args.codec, timeout=600, dim=cfg.dim)
        inputs.append(h)
    last = await client.backward(peers[-1], "mb0", inputs[-1], targets=x, reply_codec=args.codec, timeout=600,
                                 dim=cfg.dim)
    grad = last.grad_inputs
    for peer, inp in zip(reversed(peers[:-1]), reversed(inputs[:-1]), strict=True):
        grad = (await client.backward(peer, "mb0", inp, grad_outputs=grad, reply_codec=args.codec, timeout=600,
                                      dim=cfg.dim)).grad_inputs
    return last.loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="base")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--codec", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--message-cap-mb", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = pipeline_model_config(args.preset, args.stages)
    spans = split_layers(cfg.n_layers, args.stages)
    ca = CertificateAuthority.create("stage-memory")
    procs, ready = [], []
    loop = LoopThread()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for s in range(args.stages):
                proc, rec = start_peer(Path(tmp) / f"peer{s}", ca, s, args)
                procs.append(proc)
                ready.append(rec)
                print(f"stage {s}: {rec['stage_param_mb']:.1f} MiB of weights, built at "
                      f"+{rec['built_peak_rss_mb'] - rec['start_rss_mb']:.1f} MiB RSS", flush=True)
            client = StageClient(ca.issue(), run_id=RUN, max_message_bytes=int(args.message_cap_mb * MIB))
            peers = [StageEndpoint(r["node_id"], r["address"], r["stage"]) for r in ready]
            loss = loop.run(one_microbatch(client, peers, args, cfg))
            streamed = client.streamed
            loop.run(client.aclose())
        finally:
            stopped = []
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                out, _ = proc.communicate(timeout=300)
                stopped.append(next(json.loads(x) for x in out.splitlines() if '"stopped"' in x))
            loop.stop()
    whole = subprocess.run([sys.executable, "-c", WHOLE, args.preset, str(args.stages)], capture_output=True,
                           text=True, cwd=ROOT, check=True)
    params = cfg.num_params()
    rows = [
        {"stage": r["stage"], "blocks": spans[r["stage"]].end_block - spans[r["stage"]].first_block,
         "stage_param_mb": r["stage_param_mb"], "start_rss_mb": r["start_rss_mb"],
         "build_rss_mb": round(r["built_peak_rss_mb"] - r["start_rss_mb"], 1),
         "step_rss_mb": round(st["peak_rss_mb"] - r["start_rss_mb"], 1), "optimizer_steps": st["optimizer_steps"]}
        for r, st in zip(ready, stopped, strict=True)
    ]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {
        "benchmark": "stage_memory",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": ".venv/bin/python " + shlex.join(["benchmarks/stage_memory.py", *sys.argv[1:]]),
        "commit": commit or None,
        "load": os.getloadavg()[0],
        "preset": args.preset, "stages": args.stages, "microbatch_rows": args.rows, "seq_len": cfg.seq_len,
        "codec": args.codec, "message_cap_mb": args.message_cap_mb,
        "activation_mb": round(args.rows * cfg.seq_len * cfg.dim * {"fp32": 4, "bf16": 2, "int8": 1}[args.codec] / MIB,
                               2),
        "streamed_calls": streamed, "loss": round(loss, 4),
        "params_total": params, "whole_param_mb": round(params * 4 / MIB, 1),
        "full_state_mb": round(params * 16 / MIB, 1),
        **json.loads(whole.stdout.strip().splitlines()[-1]),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
