"""Pipelined training end to end, on this machine's CPU: memory per peer against the whole model's
training state, val loss against `murmur train` at equal samples, stage peers SIGKILLed at an MTBF,
and a run whose every process is SIGKILLed at once and restarted from the stage checkpoints.

    python3 benchmarks/pipeline_train.py            # -> benchmarks/results/pipeline_train.json

Each row is a real coordinator, stage peers and one driver as processes on loopback (2 stages,
fp32 activations), training the same small Llama-style model for ``--steps`` run steps of
``train.batch_size`` sequences (the same samples, in the ledger's shard order), then:

- ``val_loss_pipeline``: `murmur export` of the stage peers' checkpoint folders (the newest
  complete set, written at the peers' clean stop), evaluated on the validation split;
  ``val_loss_single``: `murmur train` of the same model config, steps and batch on the same data,
  evaluated on the same batches; ``loss_gap_pct`` = 100 x (pipeline - single) / single.
- ``full_state_mb``: what one process needs to train the whole model: weights, gradients and AdamW's
  two moments, fp32 (16 bytes a parameter). ``peer_cap_mb`` = 0.75 x that. The cap is *measured*,
  not enforced (no RLIMIT_AS, no cgroup): ``peer_peak_rss_mb_max`` is the largest peak resident
  memory of any stage peer above its own resident memory before any of the model was built (the
  interpreter, torch and grpc, which every process pays whatever the model: ``peer_base_rss_mb``).
- ``mtbf_s``/``kills``: stage peers (2 a stage) SIGKILLed at exponential intervals with that mean and
  restarted with their state folder; ``longest_stall_s``: the longest gap between two microbatches
  the driver completed; ``microbatches_lost``: the schedule's microbatches the ledger does not hold
  at the end (the driver re-runs a microbatch whose hop failed, so 0 is the target).
- ``resumed_from_checkpoint``: every stage peer and the driver SIGKILLed at once half-way, then
  restarted: true when every restarted peer loaded its stage's checkpoint (not the seed), and the
  run went on to the end of its schedule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from murmur.node.export.source import load_source
from murmur.node.export.stage_set import load_sources
from murmur.node.model.data import Dataset, eval_batches, prepare
from murmur.node.testnet.procs import Testnet
from murmur.protocol.runconfig import load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = ["model.dim=192", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.hidden_dim=512",
         "model.seq_len=64"]
HEARTBEAT_TTL_S = 3.0


def overrides(steps: int, data: Path) -> list[str]:
    return [f'data.path="{data}"', *MODEL, f"train.steps={steps}", "train.batch_size=8", "train.eval_every=100000",
            "train.eval_batches=4", "optim.lr=3e-3", "optim.warmup_steps=10",
            "pipeline.stages=2", "pipeline.microbatch_size=4", "pipeline.target_samples=8",
            "pipeline.activation_codec=fp32", "pipeline.checkpoint_every_s=2.0", "pipeline.sync_every_s=5.0",
            "pipeline.replica_every_s=2.0", "pipeline.rebalance_every_s=600.0", "pipeline.hop_timeout_s=30.0"]


class Proc:
    """A process whose JSON lines on stdout are collected by a thread."""

    def __init__(self, module: str, args: list[str], log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.err = open(log, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                     stderr=self.err, env=env, text=True, start_new_session=True, cwd=REPO)
        self.records: list[dict] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            r.setdefault("seen_at", time.time())
            self.records.append(r)
            if r.get("event") == "ready":
                self.ready.set()

    def of(self, event: str) -> list[dict]:
        return [r for r in self.records if r.get("event") == event]

    def wait_ready(self, timeout: float = 300) -> dict:
        end = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"a process did not get ready (rc {self.proc.poll()}); see {self.err.name}")
        return self.of("ready")[-1]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(120)


def start_peer(join: tuple[str, str], state: Path) -> Proc:
    return Proc("murmur.node.pipeline.stage_peer_process",
                ["--coordinator", join[0], "--token", join[1], "--state-dir", str(state), "--progress-every", "0"],
                state.with_suffix(".log"))


def start_driver(join: tuple[str, str], data: Path, root: Path, name: str) -> Proc:
    return Proc("murmur.node.pipeline.driver_process",
                ["--coordinator", join[0], "--token", join[1], "--data", str(data),
                 "--commit-log", str(root / f"{name}.commits")], root / f"{name}.log")


def ledger_tokens(db: Path) -> int:
    import sqlite3

    con = sqlite3.connect(db)
    try:
        return int(con.execute("SELECT COALESCE(SUM(committed_offset), 0) FROM shards").fetchone()[0])
    finally:
        con.close()


def val_of(source, batches) -> float:
    model = source.build_model()
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in batches) / len(batches)


def run_row(root: Path, data: Path, steps: int, *, peers_per_stage: int, mtbf_s: float, kill_all: bool,
            seed: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(REPO / "configs" / "testnet-tiny.toml", overrides(steps, data))
    (root / "run.toml").write_text(cfg.to_toml())
    net = Testnet(root=root, config_path=root / "run.toml", data=data,
                  coordinator_args=["--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--restart-grace", "1"])
    rng = random.Random(seed)
    n = 2 * peers_per_stage
    states = [root / f"peer-{i}" for i in range(n)]
    peers: list[Proc] = []
    drivers: list[Proc] = []
    kills, restarts_from_ckpt = 0, []
    t_start = time.time()
    try:
        net.start_coordinator()
        join = (str(net.info["address"]), net.create_run(100))
        for s in states:
            peers.append(start_peer(join, s))
            peers[-1].wait_ready()
        drivers.append(start_driver(join, data, root, "driver-0"))
        schedule_tokens = steps * 8 * 64
        next_kill = time.time() + rng.expovariate(1 / mtbf_s) if mtbf_s > 0 else math.inf
        killed_all = False
        while drivers[-1].proc.poll() is None:
            time.sleep(0.5)
            if kill_all and not killed_all and ledger_tokens(net.db) >= schedule_tokens // 2:
                time.sleep(3.0)  # past a checkpoint instant (every 2 s)
                for p in [*peers, drivers[-1]]:
                    p.proc.send_signal(signal.SIGKILL)
                for p in [*peers, drivers[-1]]:
                    p.kill()
                killed_all, kills = True, kills + n
                peers = [start_peer(join, s) for s in states]
                for p in peers:
                    restarts_from_ckpt.append(p.wait_ready()["state_source"] == "checkpoint")
                drivers.append(start_driver(join, data, root, f"driver-{len(drivers)}"))
            if time.time() >= next_kill:
                i = rng.randrange(n)
                peers[i].kill()
                kills += 1
                peers[i] = start_peer(join, states[i])
                peers[i].wait_ready()
                next_kill = time.time() + rng.expovariate(1 / mtbf_s)
        tokens = ledger_tokens(net.db)
        for p in peers:  # a clean stop of the run, all at once: each peer writes its checkpoint
            p.proc.send_signal(signal.SIGTERM)
        for p in peers:
            p.kill(signal.SIGTERM)
    finally:
        for p in [*peers, *drivers]:
            if p.proc.poll() is None:
                p.proc.kill()
        net.stop_coordinator()
    wall = time.time() - t_start
    done = [r for d in drivers for r in d.of("done")]
    ats = sorted(r["seen_at"] for d in drivers for r in d.of("microbatch"))
    stall = max((b - a for a, b in zip(ats, ats[1:], strict=False)), default=0.0)
    peaks = [r for p in peers for r in p.of("stopped")]
    readies = [r for p in peers for r in p.of("ready")]
    base = max(r["start_rss_mb"] for r in readies)
    peak_over_base = max(s["peak_rss_mb"] - r["start_rss_mb"] for s, r in zip(peaks, readies, strict=False))
    source = load_sources(states)
    return {
        "stages": 2, "peers_per_stage": peers_per_stage, "samples": steps * 8, "tokens_ledger": tokens,
        "driver_exit": [d.proc.returncode for d in drivers], "driver_reason": [d.get("reason") for d in done],
        "peer_base_rss_mb": round(base, 1), "peer_peak_rss_mb_max": round(peak_over_base, 1),
        "mtbf_s": mtbf_s or None, "kills": kills, "longest_stall_s": round(stall, 2),
        "microbatches_lost": max(0, (steps * 8 * 64 - tokens) // (4 * 64)),
        "resumed_from_checkpoint": bool(restarts_from_ckpt) and all(restarts_from_ckpt),
        "wall_s": round(wall, 1), "_source": source,
        # where a peer's memory grows: before the model, once its stage was built, when it served, at its stop
        "peer_rss_detail": [{"stage": r["stage"], "start_rss_mb": r["start_rss_mb"],
                             "built_peak_rss_mb": r["built_peak_rss_mb"], "ready_peak_rss_mb": r["peak_rss_mb"],
                             "stop_peak_rss_mb": s["peak_rss_mb"], "stage_param_mb": r["stage_param_mb"]}
                            for s, r in zip(peaks, readies, strict=False)],
    }


def single(root: Path, data: Path, steps: int) -> Path:
    # the same run without its [pipeline] section: `murmur train` trains the whole model in one process
    cfg = load_config(REPO / "configs" / "testnet-tiny.toml",
                      [o for o in overrides(steps, data) if not o.startswith("pipeline.")])
    (root / "single.toml").write_text(cfg.to_toml())
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = root / "single-run"
    subprocess.run([sys.executable, "-m", "murmur.cli", "train", "--config", str(root / "single.toml"), "--device",
                    "cpu", "--out", str(out)], check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--work", default="/tmp/murmur-pipeline-train")
    ap.add_argument("--results", default=str(RESULTS / "pipeline_train.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    data = work / "data"
    prepare(data, tokenizer="byte", shard_tokens=1 << 14)
    batches = eval_batches(Dataset.open(data), 4, 64, 8)
    load0 = os.getloadavg()
    t0 = time.time()
    single_val = val_of(load_source(single(work, data, args.steps)), batches)
    rows = []
    for name, kw in (("no kills", {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False}),
                     ("kills at MTBF 30 s", {"peers_per_stage": 2, "mtbf_s": 30.0, "kill_all": False}),
                     ("all killed at once, resumed", {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": True})):
        row = run_row(work / name.replace(" ", "-").replace(",", ""), data, args.steps, seed=len(rows), **kw)
        source = row.pop("_source")
        params = sum(t.numel() for t in source.weights.values())
        full = params * 16 / 2**20
        val = val_of(source, batches)
        rows.append({
            "row": name, "stages": row["stages"], "peers_per_stage": row["peers_per_stage"], "params_total": params,
            "full_state_mb": round(full, 2), "peer_cap_mb": round(0.75 * full, 2), **{
                k: row[k] for k in ("peer_peak_rss_mb_max", "peer_base_rss_mb")},
            "samples": row["samples"], "val_loss_pipeline": round(val, 4), "val_loss_single": round(single_val, 4),
            "loss_gap_pct": round(100 * (val - single_val) / single_val, 2),
            **{k: row[k] for k in ("mtbf_s", "kills", "longest_stall_s", "microbatches_lost",
                                   "resumed_from_checkpoint", "tokens_ledger", "driver_exit", "driver_reason",
                                   "wall_s", "peer_rss_detail")},
            "checkpoint_version": source.provenance["round"],
        })
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO).stdout)
    out = {
        "benchmark": "pipeline_train", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"cpu ({os.cpu_count()} cores)", "command": "python3 benchmarks/pipeline_train.py "
        + " ".join(sys.argv[1:]), "commit": commit, "tree_dirty": dirty,
        "load_avg_at_start": [round(x, 2) for x in load0], "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.time() - t0, 1),
        "memory_cap": "measured, not enforced: peak RSS above the process's own pre-model RSS (interpreter, torch, "
                      "grpc) against 0.75 x full_state_mb",
        "rows": rows,
    }
    Path(args.results).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
