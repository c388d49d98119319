"""Stage peers on a GPU, end to end: `murmur testnet up --stages S --device cuda` on one card, each
peer's GPU memory against its share of the model, and the drivers' loss.

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    source benchmarks/gpu_env.sh && python3 benchmarks/pipeline_gpu.py --out $OUT/pipeline-gpu

runs configs/pipeline-gpu.toml (2.06B parameters, 32.9 GB of training state: more than a 24 GB card
holds; 6 stages of 4.9-6.6 GB) with a short warm-up (``--set optim.warmup_steps=20``: the shipped
200-step warm-up would keep the lr near zero for the minutes this runs; 2 steps took the loss from
11.3 to 13-17 at the first steps of full lr), 6 stage peers and one
driver on one GPU for --duration seconds, then stops them (SIGTERM: each writes its checkpoint).
Stage peers start with exec, never forked from the testnet's warm-start server
(node/testnet/warm.py). Writes pipeline_gpu.json into the results folder beside this script (and a
copy under --out; none is committed until a GPU runs it): per
peer its stage, ``stage_state_mb`` (weights + gradients + AdamW's two moments, fp32: its share),
``gpu_peak_mb`` (torch.cuda.max_memory_allocated: its tensors' peak) and ``gpu_reserved_peak_mb``,
their ratio to the share, its optimizer steps and checkpoints, the checkpoint files left on disk;
the drivers' first and last losses (means of 8 microbatches) and whether it fell. From outside,
every 5 s, ``nvidia-smi``'s memory of each peer's process (its CUDA context and the caching
allocator's pool included: what the card must have free for it), kept as each peer's
``smi_peak_mb`` and as a time series in gpu_samples.jsonl under --out (written as it goes, so a
run cut short still shows its memory).

A CPU smoke test of the script (a tiny model, seconds of training):
    .venv/bin/python benchmarks/pipeline_gpu.py --device cpu --config configs/pipeline-cpu.toml \\
        --stages 2 --nodes 2 --duration 20 --set optim.warmup_steps=2 --out /tmp/pg --results /tmp/pg.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "pipeline_gpu.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "pipeline-gpu.toml"))
    ap.add_argument("--stages", type=int, default=6)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--drivers", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--duration", type=float, default=240.0, help="the drivers' seconds of training")
    ap.add_argument("--set", action="append", default=None,
                    help="run config overrides (default: optim.warmup_steps=20)")
    ap.add_argument("--out", default="/tmp/murmur-pipeline-gpu")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    args.set = args.set if args.set is not None else ["optim.warmup_steps=20"]

    from murmur.protocol.runconfig import load_config

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = load_config(Path(args.config).resolve(), args.set)
    data = Path(cfg.data.path)
    if not data.is_absolute():
        cfg.data.path = str((REPO / data).resolve())  # the testnet prepares it there if missing
    config = out / "run.toml"
    config.write_text(cfg.to_toml())
    cmd = [sys.executable, "-m", "murmur.cli", "testnet", "up", "--stages", str(args.stages), "--nodes",
           str(args.nodes), "--drivers", str(args.drivers), "--config", str(config), "--device", args.device,
           "--duration", str(args.duration), "--out", str(out / "testnet")]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    on_gpu = args.device.startswith("cuda") and shutil.which("nvidia-smi")
    smi = SmiSampler(out / "gpu_samples.jsonl") if on_gpu else None
    # From "/": in the repository root, python -m puts the root's murmur/ folder (the CLI alone)
    # before the package benchmarks/gpu_env.sh lays out.
    rc = subprocess.run(cmd, cwd="/", env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    wall = time.time() - t0
    smi_peaks = smi.stop() if smi is not None else {}
    nodes = out / "testnet" / "nodes"
    peers = []
    for f in sorted(nodes.glob("peer-*.jsonl")):
        recs = [json.loads(x) for x in f.read_text().splitlines() if x.startswith("{")]
        ready = [r for r in recs if r.get("event") == "ready"]
        stopped = [r for r in recs if r.get("event") == "stopped"]
        if not ready:
            peers.append({"peer": f.stem, "ready": False})
            continue
        last = stopped[-1] if stopped else ready[-1]
        share = 4 * ready[-1]["stage_param_mb"]
        ckpts = sorted(p.name for p in (nodes / f.stem / "stage-checkpoints").glob("*.pt"))
        peers.append({
            "peer": f.stem, "stage": ready[-1]["stage"], "stage_state_mb": round(share, 1),
            "gpu_peak_mb": last.get("gpu_peak_mb"), "gpu_reserved_peak_mb": last.get("gpu_reserved_peak_mb"),
            "gpu_peak_of_share": round(last["gpu_peak_mb"] / share, 3) if last.get("gpu_peak_mb") else None,
            "smi_peak_mb": smi_peaks.get(f.stem),
            "smi_peak_of_share": round(smi_peaks[f.stem] / share, 3) if f.stem in smi_peaks else None,
            "peak_rss_mb": last.get("peak_rss_mb"), "stopped": bool(stopped),
            "optimizer_steps": last.get("optimizer_steps"), "checkpoints_written": last.get("checkpoints_written"),
            "checkpoint_files": ckpts,
        })
    summary_path = out / "testnet" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    drivers = summary.get("drivers", [])
    result = {
        "benchmark": "pipeline_gpu", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": _device(args.device), "command": "python3 benchmarks/pipeline_gpu.py " + " ".join(sys.argv[1:]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip(),
        "config": args.config, "overrides": args.set, "testnet_exit": rc, "wall_s": round(wall, 1),
        "peers": peers, "drivers": drivers,
        "loss_fell": bool(drivers) and all(d.get("last_loss") is not None and d.get("first_loss") is not None
                                           and d["last_loss"] < d["first_loss"] for d in drivers),
        "exit_codes": summary.get("exit_codes"),
    }
    text = json.dumps(result, indent=1) + "\n"
    Path(args.results).write_text(text)
    (out / "pipeline_gpu.json").write_text(text)
    print(text)
    return 0 if rc == 0 else 1


class SmiSampler:
    """Each testnet process's GPU memory as nvidia-smi reports it, every ``every_s`` seconds, named by
    the peer or driver folder on its command line; appended to ``path`` as it goes."""

    def __init__(self, path: Path, every_s: float = 5.0) -> None:
        self.path, self.every_s = path, every_s
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peaks

    def _run(self) -> None:
        t0 = time.time()
        while not self._stop.wait(self.every_s):
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            res = subprocess.run(query, capture_output=True, text=True)
            sample: dict[str, float] = {}
            for line in res.stdout.splitlines():
                pid, _, mb = line.partition(",")
                try:
                    cmdline = Path(f"/proc/{pid.strip()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    used = float(mb)
                except (OSError, ValueError):
                    continue
                names = re.findall(r"\b((?:peer|driver)-\d+)\b", cmdline)
                name = names[-1] if names else f"pid-{pid.strip()}"
                sample[name] = used
                self.peaks[name] = max(used, self.peaks.get(name, 0.0))
            with self.path.open("a") as f:
                f.write(json.dumps({"t": round(time.time() - t0, 1), "mb": sample}) + "\n")


def _device(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    raise SystemExit(main())
