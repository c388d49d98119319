"""A murmur node on a GPU, end to end: what the daemon costs against `murmur train` alone.

Three measurements in one go, every one through the real entry points (subprocesses):
  train alone   `murmur train` on the run config's model and batch, a fixed number of steps; the
                first --warmup-steps (torch.compile, allocator warm-up) are not counted
  1 node        `murmur testnet up --nodes 1 --device cuda`: coordinator, DHT, one node daemon
                (leases, commits, per-round hash, checkpoint and state publishing, the exchange)
  2 nodes       `--nodes 2` on the same GPU (gpu_share 0.5): rounds over loopback gRPC;
                every round both nodes recorded must carry the same global-state hash

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    source benchmarks/gpu_env.sh && python3 benchmarks/node_gpu.py --commit "$(git rev-parse HEAD)"
writes benchmarks/results/node_gpu.json. A node's figures come from its rounds.jsonl (node state
folder): ``tokens_per_s_node`` is tokens over the wall time between its round records (so it pays
for everything the daemon does between windows too), ``round_s`` a record's ``seconds`` (the
window of H inner steps with its exchange), ``exchange_s`` its ``seconds - compute_seconds``;
the first --warmup-rounds records (compilation) are not counted. ``overhead_pct`` is
``100 * (1 - tokens_per_s_node / (tokens_per_s_train_alone * gpu_share))``.

The bundled corpus is ~1.5M GPT-2 tokens, a few seconds of an H200, and a run ends when its data
is done; so the dataset is the bundled Shakespeare repeated --copies times (the same text: the
loss means nothing here, the throughput does). A CPU smoke test of the script:
    .venv/bin/python benchmarks/node_gpu.py --device cpu --copies 1 --shard-tokens 262144 \\
        --train-steps 3 --warmup-steps 1 --warmup-rounds 1 --durations 1:70,2:100 --threads 1 \\
        --out /tmp/node-gpu --results /tmp/node_gpu.json --set model.preset=\\"tiny\\" \\
        --set model.dim=32 --set model.n_layers=1 --set model.seq_len=32 --set train.batch_size=1 \\
        --set sync.inner_steps=2 --set sync.overlap_steps=1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "node_gpu.json"
CONFIG = "configs/testnet-gpu.toml"
# `murmur train`'s progress line: "step   12/200 | loss 7.1234 | lr 1.00e-04 | 123,456 tok/s | 130 ms"
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+ \| loss \S+ \| lr \S+ \| ([\d,]+) tok/s \| (\d+) ms")
NO_EVAL = "train.eval_every=1000000000"  # validation is neither side's work in this comparison
# `murmur train` waits for the device only on the steps it logs: logging every 10th step lets it queue
# steps ahead, its fastest (a node keeps up to three steps queued: node/daemon/window.py).
TRAIN_LOG_EVERY = "train.log_every=10"
# `python -m murmur.cli` puts its working directory first on sys.path, and in the repository root
# the folder murmur/ (the CLI alone) would hide the package gpu_env.sh lays out: run elsewhere.
WORK_DIR = Path("/")


def murmur(*args: str) -> list[str]:
    return [sys.executable, "-m", "murmur.cli", *args]


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log`` (and echoed), return (exit code, output)."""
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=WORK_DIR)
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            f.write(line)
            lines.append(line)
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                break
        code = proc.wait()
    print(f"  exit {code} after {time.monotonic() - t0:.0f}s; log {log}", flush=True)
    return code, "".join(lines)


def prepare_data(path: Path, copies: int, shard_tokens: int) -> None:
    """The bundled corpus repeated ``copies`` times, GPT-2 tokens, through `murmur data prepare`."""
    if (path / "manifest.json").is_file():
        return
    from murmur.node.model.corpus import bundled_corpus

    src = str(bundled_corpus())
    cmd = murmur("data", "prepare", "--out", str(path), "--tokenizer", "gpt2",
                 "--shard-tokens", str(shard_tokens), *[a for _ in range(copies) for a in ("--source", src)])
    print("$ murmur data prepare ... (" + f"{copies} copies of {src})", flush=True)
    subprocess.run(cmd, check=True, cwd=WORK_DIR)


def train_alone(args: argparse.Namespace, data: Path, sets: list[str]) -> dict:
    cmd = murmur("train", "--config", args.config, "--device", args.device, "--steps", str(args.train_steps),
                 "--data", str(data), "--out", str(args.out / "train"), *sets, "--set", TRAIN_LOG_EVERY)
    code, text = run_logged(cmd, args.out / "train.log", args.step_timeout)
    steps = [(int(m[1]), float(m[2].replace(",", "")), float(m[3]))
             for m in map(STEP_LINE.match, text.splitlines()) if m]
    # A line's rate and ms are the means of the steps since the line before (equal counts).
    measured = [(tps, ms) for step, tps, ms in steps if step > args.warmup_steps]
    if code != 0 or not measured:
        return {"exit": code, "error": "no measured steps: see train.log"}
    tokens = sum(tps * ms / 1000 for tps, ms in measured)
    seconds = sum(ms / 1000 for _, ms in measured)
    return {"exit": code, "steps_measured": len(measured), "tokens_per_s": round(tokens / seconds, 1),
            "step_ms_median": statistics.median(ms for _, ms in measured)}


def node_figures(recs: list[dict], warmup_rounds: int) -> dict:
    """One node's rates from its round records, the first ``warmup_rounds`` left out."""
    trained = sorted((r for r in recs if "loss" in r), key=lambda r: r["time"])
    kept = trained[warmup_rounds:]
    if len(kept) < 2:
        return {"rounds": len(trained), "error": f"only {len(trained)} rounds: too few to measure"}
    # Wall rate: the tokens of every window after the first kept one, over the time between their
    # records (the first kept record is the clock's start).
    wall = kept[-1]["time"] - kept[0]["time"]
    tokens_after = sum(r["tokens"] for r in kept[1:])
    seconds = [r["seconds"] for r in kept]
    exchange = [r["seconds"] - r["compute_seconds"] for r in kept]
    gaps = [b["time"] - a["time"] - b["seconds"] for a, b in zip(kept, kept[1:], strict=False)]
    # The same wall rate over the second half of the kept rounds: torch's page-locked memory grows
    # over a node's first rounds (each new block holds CUDA's context lock), a long run's is steady.
    late = kept[len(kept) // 2 - 1 :]
    late_wall = late[-1]["time"] - late[0]["time"]
    return {
        "rounds": len(trained),
        "rounds_measured": len(kept),
        "tokens_per_s_wall": tokens_after / wall if wall > 0 else 0.0,
        "tokens_per_s_wall_second_half": sum(r["tokens"] for r in late[1:]) / late_wall if late_wall > 0 else 0.0,
        "tokens_per_s_round": sum(r["tokens"] for r in kept) / sum(seconds),
        "tokens_per_s_compute": sum(r["tokens"] for r in kept) / sum(r["compute_seconds"] for r in kept),
        "round_s": statistics.mean(seconds),
        "exchange_s": statistics.mean(exchange),
        "exchange_wait_s": statistics.mean(r.get("exchange_wait_seconds", 0.0) for r in kept),
        "between_rounds_s": statistics.mean(gaps),  # the training thread's work between windows
        # of which: copying the state the next window overwrites (its page-locked memory included)
        "snapshot_s": statistics.mean(r.get("snapshot_seconds", 0.0) for r in kept[:-1]),
        "peers": max(int(r.get("peers", 0)) for r in kept),
        "left_out_rounds": sum(1 for r in trained if r.get("contributed") is False),
        "bytes_sent_per_round": (kept[-1]["bytes_sent"] - kept[0]["bytes_sent"]) / (len(kept) - 1),
    }


def hash_agreement(per_node: list[list[dict]]) -> dict:
    """Rounds every node recorded, and in how many of them all the hashes are the same."""
    maps = [{r["round"]: r["hash"] for r in recs if "hash" in r} for recs in per_node]
    common = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
    agree = [k for k in common if len({m[k] for m in maps}) == 1]
    return {"common_rounds": len(common), "agreeing": len(agree),
            "disagreeing_rounds": [k for k in common if k not in agree][:20],
            "last_common_round": common[-1] if common else None,
            "last_hash": maps[0][common[-1]][:16] if common else None}


def testnet(args: argparse.Namespace, nodes: int, duration: float, data: Path, sets: list[str]) -> dict:
    from murmur.node.daemon.state_dir import read_rounds

    out = args.out / f"testnet-{nodes}"
    cmd = murmur("testnet", "up", "--nodes", str(nodes), "--device", args.device, "--config", args.config,
                 "--duration", str(duration), "--out", str(out), "--threads", str(args.threads),
                 "--set", f"data.path={json.dumps(str(data))}", *sets)
    code, _ = run_logged(cmd, args.out / f"testnet-{nodes}.log", duration + args.step_timeout)
    recs = [read_rounds(out / "nodes" / f"node-{i}") for i in range(nodes)]
    figures = [node_figures(r, args.warmup_rounds) for r in recs]
    return {"exit": code, "nodes": figures, "hashes": hash_agreement(recs) if nodes > 1 else None}


def row_of(nodes: int, preset: str, tn: dict, alone: float | None) -> dict:
    good = [f for f in tn["nodes"] if "error" not in f]
    share = 1.0 / nodes
    row: dict = {"nodes": nodes, "preset": preset, "gpu_share": share, "testnet_exit": tn["exit"]}
    if len(good) != nodes:
        # A node short of rounds: the others' figures are kept for reading, not as the row's.
        row["error"] = "; ".join(f"node-{i}: {f['error']}" for i, f in enumerate(tn["nodes"]) if "error" in f)
    if good and len(good) == nodes:
        node_tps = statistics.mean(f["tokens_per_s_wall"] for f in good)
        late_tps = statistics.mean(f["tokens_per_s_wall_second_half"] for f in good)
        row.update(
            tokens_per_s_node=round(node_tps, 1),
            tokens_per_s_train_alone=alone,
            overhead_pct=round(100 * (1 - node_tps / (alone * share)), 1) if alone else None,
            overhead_pct_second_half=round(100 * (1 - late_tps / (alone * share)), 1) if alone else None,
            round_s=round(statistics.mean(f["round_s"] for f in good), 3),
            exchange_s=round(statistics.mean(f["exchange_s"] for f in good), 3),
        )
    h = tn["hashes"]
    if h is not None:
        row["hash_agreement"] = f"{h['agreeing']}/{h['common_rounds']} rounds" if h["common_rounds"] else "none"
    else:
        row["hash_agreement"] = None
    row["per_node"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()} for f in tn["nodes"]]
    if h is not None:
        row["hashes"] = h
    return row


def device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def git_commit(given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, for every run")
    ap.add_argument("--copies", type=int, default=24, help="times the bundled corpus is repeated (default 24)")
    ap.add_argument("--shard-tokens", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--warmup-steps", type=int, default=30, help="train-alone steps not counted")
    ap.add_argument("--warmup-rounds", type=int, default=2, help="a node's first rounds not counted")
    ap.add_argument("--durations", default="1:120,2:150", help="NODES:SECONDS of each testnet, comma-separated")
    ap.add_argument("--threads", type=int, default=4, help="torch threads per node")
    ap.add_argument("--step-timeout", type=float, default=240.0, help="seconds a step may take beyond its duration")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "node-gpu", help="runs, logs, the data")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--logs", type=Path, help="also pack every log into this .tar.gz")
    ap.add_argument("--commit", help="the commit of the tree that runs (default: git rev-parse HEAD)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    args.config_name, args.config = args.config, str((ROOT / args.config).resolve())  # runs are not in ROOT
    runs = [(int(n), float(s)) for n, s in (item.split(":") for item in args.durations.split(","))]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    from murmur.protocol.runconfig import load_config

    sets = [a for s in [*args.set, NO_EVAL] for a in ("--set", s)]
    preset = load_config(args.config, list(args.set)).model.preset
    data = args.out / f"shakespeare-gpt2-x{args.copies}"
    t0 = time.monotonic()
    prepare_data(data, args.copies, args.shard_tokens)
    shards = len(json.loads((data / "manifest.json").read_text())["shards"])
    if shards < max(n for n, _ in runs):
        # A node finding every shard leased leaves the run: each node needs a shard of its own.
        sys.exit(f"{data} has {shards} shards for up to {max(n for n, _ in runs)} nodes: lower --shard-tokens")
    print(f"data ready after {time.monotonic() - t0:.0f}s", flush=True)
    alone = train_alone(args, data, sets)
    print(f"train alone: {alone}", flush=True)
    rows: list[dict] = []
    write_results(args, alone, rows)  # after every step: a run cut short still leaves its figures
    try:
        for nodes, duration in runs:
            tn = testnet(args, nodes, duration, data, sets)
            rows.append(row_of(nodes, preset, tn, alone.get("tokens_per_s")))
            print(json.dumps(rows[-1]), flush=True)
            write_results(args, alone, rows)
    finally:
        if args.logs:
            with tarfile.open(args.logs, "w:gz") as tar:
                for p in sorted([*args.out.rglob("*.log"), *args.out.rglob("rounds.jsonl")]):
                    tar.add(p, arcname=str(p.relative_to(args.out)))
    print(f"wrote {args.results} after {time.monotonic() - t0:.0f}s", flush=True)


def write_results(args: argparse.Namespace, alone: dict, rows: list[dict]) -> None:
    result = {
        "benchmark": "node_gpu",
        "device": device_name(args.device),
        "date": dt.date.today().isoformat(),
        "command": "python3 " + shlex.join(sys.argv),
        "commit": git_commit(args.commit),
        "config": args.config_name,
        "train_alone": alone,
        "rows": rows,
        "notes": (
            "tokens_per_s_node: tokens over the wall time between a node's round records (everything "
            f"the daemon does between windows counted), the first {args.warmup_rounds} rounds left out; "
            f"tokens_per_s_train_alone: `murmur train` on the same config, steps after the first "
            f"{args.warmup_steps} (it logs, and waits for the device, every 10th step; a node keeps up to "
            f"three steps queued ahead of the device); "
            "overhead_pct_second_half: the same over the second half of the measured rounds; "
            "overhead_pct = 100*(1 - node/(alone*gpu_share)); round_s: a record's "
            "seconds (H inner steps and the exchange), exchange_s: seconds - compute_seconds (the window's "
            "waits for the exchange and for leases); per_node "
            "also gives the rates over round time and compute time, between_rounds_s (the training thread's "
            "time between windows) and snapshot_s (of it, the copies of the state for the round's hash, "
            "checkpoint and publishing); validation off on both sides; data: the bundled "
            f"Shakespeare repeated {args.copies} times (GPT-2 tokens); {args.threads} torch threads per node"
        ),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
