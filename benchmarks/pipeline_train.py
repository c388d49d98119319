"""Pipelined training end to end, on this machine's CPU: memory per peer against the whole model's
training state, val loss against `murmur train` at equal samples, stage peers SIGKILLed at an MTBF,
and a run whose every process is SIGKILLed at once and restarted from the stage checkpoints.

    python3 benchmarks/pipeline_train.py                 # every row -> benchmarks/results/pipeline_train.json
    python3 benchmarks/pipeline_train.py --rows memory --results /tmp/memory.json   # one row alone

``--rows`` picks rows by key (comma-separated): ``loss`` (no kills), ``kills`` (MTBF 30 s),
``resume`` (all killed at once), ``memory``; the results file holds the rows run, so run one row
alone into another file to keep the committed one. Each row is a real coordinator, stage peers and
drivers as processes on loopback (fp32 activations), training for a number of run steps of
``train.batch_size`` sequences (the same samples, in the ledger's shard order), then:

- ``loss``, ``kills``, ``resume``: a small Llama-style model (1.9M parameters), 2 stages, one
  driver, ``--steps`` run steps of 8 sequences of 64 tokens.
- ``memory``: a model whose training state dwarfs a process's fixed costs (168M parameters: dim
  1024, 16 blocks, hidden 2048; full_state_mb 2.6 GB), 8 stages of one peer each (2 blocks a
  peer), 2 drivers, ``--memory-steps`` run steps of 4 sequences of 32 tokens (microbatches of 2),
  replicas every 10 s and checkpoints every 30 s and at the stop, as in a real run; no
  within-stage sync (``pipeline.sync_every_s = 0``): a stage of one peer has no mate to sync with
  (a stage with mates holds the sync's anchor, momentum and their published copy besides).
- ``val_loss_pipeline``: `murmur export` of the stage peers' checkpoint folders (the newest
  complete set, written at the peers' clean stop), evaluated on the validation split;
  ``val_loss_single``: `murmur train` of the same model config, steps and batch on the same data,
  evaluated on the same batches; ``loss_gap_pct`` = 100 x (pipeline - single) / single, given
  only where the ledger holds exactly the schedule's samples (``equal_samples``).
- ``full_state_mb``: what one process needs to train the whole model: weights, gradients and AdamW's
  two moments, fp32 (16 bytes a parameter). ``peer_cap_mb`` = 0.75 x that. The cap is *measured*,
  not enforced (no RLIMIT_AS: torch and grpc reserve far more address space than they touch; no
  cgroup): ``peer_peak_rss_mb_max`` is the largest peak resident memory of any stage peer's whole
  process (VmHWM of /proc/self/status, which each peer reports at its clean stop, after the
  checkpoint it writes there: the interpreter, torch, grpc and the stage together), and
  ``peer_peak_rss_mb`` the list, one per peer; ``under_cap``: the target
  ``peer_peak_rss_mb_max <= peer_cap_mb < full_state_mb``; ``peer_peak_of_full``: the peak as a
  share of full_state_mb. ``peer_base_rss_mb`` is a peer's resident memory before any of the model
  was built (what every process pays whatever the model), ``peer_peak_over_base_mb_max`` the
  largest peak above it, and ``peer_rss_detail`` each peer's memory before the model, once its
  stage was built, when it served and at its stop. On the small model the fixed costs alone are
  ten times the cap: only the memory row says anything about the target.
- ``mtbf_s``/``kills``: stage peers (2 a stage) SIGKILLed at exponential intervals with that mean and
  restarted with their state folder, which keeps their identity: each comes back as the same node,
  and the coordinator replaces its entry at its first heartbeat (rows from before the stage peers
  kept their identity restarted each as a new node, its dead entry listed until the heartbeat TTL);
  ``longest_stall_s``: the longest gap between two microbatches the drivers completed;
  ``microbatches_lost``: the schedule's microbatches the ledger does not hold at the end (the driver
  re-runs a microbatch whose hop failed, so 0 is the target); ``samples_committed``: the ledger's
  total in sequences (two drivers may each finish a microbatch past the schedule's end: the ledger
  counts those too).
- ``resumed_from_checkpoint``: every stage peer and the driver SIGKILLed at once half-way, then
  restarted with their state folders: true when every restarted peer loaded its stage's checkpoint
  (not the seed), and the run went on to the end of its schedule. The restarted driver is the same
  node and gets its lease back at once (rows from before drivers kept a state folder restarted it
  as a new node, which waited for the dead one's lease to expire or took another shard).
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
from dataclasses import dataclass
from pathlib import Path

import torch

from murmur.node.export.source import load_source
from murmur.node.export.stage_set import load_sources
from murmur.node.model.data import Dataset, eval_batches, prepare
from murmur.node.pipeline import stage_checkpoint
from murmur.node.testnet.procs import Testnet, wait_for
from murmur.protocol.runconfig import load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HEARTBEAT_TTL_S = 3.0


@dataclass(frozen=True)
class Shape:
    """A row's model and pipeline: what its run config overrides."""

    model: dict[str, int]
    stages: int
    batch_size: int  # sequences per run step (train.batch_size)
    microbatch: int  # rows per microbatch (pipeline.microbatch_size)
    pipeline: tuple[str, ...] = ()  # further pipeline.* overrides

    @property
    def seq_len(self) -> int:
        return self.model["seq_len"]


# The loss and churn rows: a small model, 2 stages, short checkpoint and replica periods.
TINY = Shape({"dim": 192, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "hidden_dim": 512, "seq_len": 64},
             stages=2, batch_size=8, microbatch=4,
             pipeline=("pipeline.checkpoint_every_s=2.0", "pipeline.sync_every_s=5.0", "pipeline.replica_every_s=2.0",
                       "pipeline.hop_timeout_s=30.0"))
# The memory row: a model whose training state (16 bytes a parameter) dwarfs what a process pays
# before any model (~250 MB: the interpreter, torch, grpc), cut in MEMORY_STAGES stages of one peer
# each; short sequences and microbatches so that a few steps fit minutes of this CPU.
MEMORY_STAGES = 8
MEMORY = Shape({"dim": 1024, "n_layers": 16, "n_heads": 8, "n_kv_heads": 8, "hidden_dim": 2048, "seq_len": 32},
               stages=MEMORY_STAGES, batch_size=4, microbatch=2,
               pipeline=("pipeline.checkpoint_every_s=30.0", "pipeline.sync_every_s=0.0",
                         "pipeline.replica_every_s=10.0", "pipeline.hop_timeout_s=300.0",
                         "pipeline.min_hop_timeout_s=60.0"))
CAP = 0.75  # peer_cap_mb, x full_state_mb (the memory row's peers peak near 0.52 x: see docs/pipeline.md)


def overrides(shape: Shape, steps: int, data: Path) -> list[str]:
    return [f'data.path="{data}"', *(f"model.{k}={v}" for k, v in shape.model.items()), f"train.steps={steps}",
            f"train.batch_size={shape.batch_size}", "train.eval_every=100000", "train.eval_batches=4",
            "optim.lr=3e-3", "optim.warmup_steps=10", f"pipeline.stages={shape.stages}",
            f"pipeline.microbatch_size={shape.microbatch}", f"pipeline.target_samples={shape.batch_size}",
            "pipeline.activation_codec=fp32", "pipeline.rebalance_every_s=600.0", *shape.pipeline]


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


def start_driver(join: tuple[str, str], data: Path, root: Path, name: str, state: Path) -> Proc:
    """A driver with its state folder: restarted with it, it is the same node (its lease is its own)."""
    return Proc("murmur.node.pipeline.driver_process",
                ["--coordinator", join[0], "--token", join[1], "--data", str(data), "--state-dir", str(state),
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


def newer_checkpoint(state_dir: Path, since: float) -> bool:
    """Whether the stage peer of ``state_dir`` has written a checkpoint after ``since`` (Unix time)."""
    c = stage_checkpoint.newest(state_dir)
    return c is not None and c.path.stat().st_mtime > since


def run_row(root: Path, data: Path, steps: int, *, shape: Shape = TINY, peers_per_stage: int, mtbf_s: float,
            kill_all: bool, seed: int, drivers: int = 1) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(REPO / "configs" / "testnet-tiny.toml", overrides(shape, steps, data))
    (root / "run.toml").write_text(cfg.to_toml())
    net = Testnet(root=root, config_path=root / "run.toml", data=data,
                  coordinator_args=["--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--restart-grace", "1"])
    rng = random.Random(seed)
    n = shape.stages * peers_per_stage
    states = [root / f"peer-{i}" for i in range(n)]
    peers: list[Proc] = []
    every_peer: list[Proc] = []  # with those killed: each one's ready line
    active: list[Proc] = []  # the drivers now running
    finished: list[Proc] = []
    kills, restarts_from_ckpt = 0, []
    schedule_tokens = steps * shape.batch_size * shape.seq_len
    t_start = time.time()
    try:
        net.start_coordinator()
        join = (str(net.info["address"]), net.create_run(100))
        for s in states:
            peers.append(start_peer(join, s))
            peers[-1].wait_ready()
        every_peer += peers
        active = [start_driver(join, data, root, f"driver-{i}", root / f"driver-state-{i}") for i in range(drivers)]
        next_kill = time.time() + rng.expovariate(1 / mtbf_s) if mtbf_s > 0 else math.inf
        killed_all = False
        while any(d.proc.poll() is None for d in active):
            time.sleep(0.5)
            if kill_all and not killed_all and ledger_tokens(net.db) >= schedule_tokens // 2:
                # Killed right after every peer wrote a checkpoint past the half-way mark, not after
                # a fixed wait: on a quiet machine the driver finished the whole schedule within
                # the 3 s this waited, and the "resumed" run then had nothing left to train.
                half_at = time.time()
                wait_for(lambda t=half_at: all(newer_checkpoint(s, t) for s in states), timeout_s=60.0, poll_s=0.05,
                         what="every peer's checkpoint past half-way")
                for p in [*peers, *active]:
                    p.proc.send_signal(signal.SIGKILL)
                for p in [*peers, *active]:
                    p.kill()
                killed_all, kills = True, kills + n
                finished += active
                peers = [start_peer(join, s) for s in states]
                for p in peers:
                    restarts_from_ckpt.append(p.wait_ready()["state_source"] == "checkpoint")
                every_peer += peers
                active = [start_driver(join, data, root, f"driver-{len(finished) + i}", root / f"driver-state-{i}")
                          for i in range(drivers)]
            if time.time() >= next_kill:
                i = rng.randrange(n)
                peers[i].kill()
                kills += 1
                peers[i] = start_peer(join, states[i])
                peers[i].wait_ready()
                every_peer.append(peers[i])
                next_kill = time.time() + rng.expovariate(1 / mtbf_s)
        finished += active
        tokens = ledger_tokens(net.db)
        for p in peers:  # a clean stop of the run, all at once: each peer writes its checkpoint
            p.proc.send_signal(signal.SIGTERM)
        for p in peers:
            p.kill(signal.SIGTERM)
    finally:
        for p in [*peers, *active]:
            if p.proc.poll() is None:
                p.proc.kill()
        net.stop_coordinator()
    wall = time.time() - t_start
    done = [r for d in finished for r in d.of("done")]
    mbs = sorted((r for d in finished for r in d.of("microbatch")), key=lambda r: r["seen_at"])
    ats = [r["seen_at"] for r in mbs]
    stall = max((b - a for a, b in zip(ats, ats[1:], strict=False)), default=0.0)
    losses = [r["loss"] for r in mbs if r.get("loss") is not None]
    # Every peer that ran to a clean stop: its ready line (memory before the model, once built) and
    # its stopped line (VmHWM at the end: the peak of its whole life, checkpoint at the stop included).
    detail = [{"stage": r["stage"], "start_rss_mb": r["start_rss_mb"], "built_peak_rss_mb": r["built_peak_rss_mb"],
               "ready_peak_rss_mb": r["peak_rss_mb"], "stop_peak_rss_mb": s["peak_rss_mb"],
               "stage_param_mb": r["stage_param_mb"], "optimizer_steps": s["optimizer_steps"]}
              for p in peers for r, s in [(p.of("ready")[-1], p.of("stopped")[-1])]]
    source = load_sources(states)
    return {
        "stages": shape.stages, "peers_per_stage": peers_per_stage, "drivers": drivers,
        "samples": steps * shape.batch_size, "tokens_ledger": tokens, "samples_committed": tokens // shape.seq_len,
        "driver_exit": [d.proc.returncode for d in finished], "driver_reason": [d.get("reason") for d in done],
        "microbatches_done": len(mbs), "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "peer_base_rss_mb": round(max(r["start_rss_mb"] for p in every_peer for r in p.of("ready")), 1),
        "peer_peak_rss_mb_max": max(d["stop_peak_rss_mb"] for d in detail),
        "peer_peak_rss_mb": [d["stop_peak_rss_mb"] for d in detail],
        "peer_peak_over_base_mb_max": round(max(d["stop_peak_rss_mb"] - d["start_rss_mb"] for d in detail), 1),
        "mtbf_s": mtbf_s or None, "kills": kills, "longest_stall_s": round(stall, 2),
        "microbatches_lost": max(0, (schedule_tokens - tokens) // (shape.microbatch * shape.seq_len)),
        "resumed_from_checkpoint": bool(restarts_from_ckpt) and all(restarts_from_ckpt),
        "wall_s": round(wall, 1), "_source": source, "peer_rss_detail": detail,
    }


def single(root: Path, data: Path, steps: int, shape: Shape) -> Path:
    # the same run without its [pipeline] section: `murmur train` trains the whole model in one process
    cfg = load_config(REPO / "configs" / "testnet-tiny.toml",
                      [o for o in overrides(shape, steps, data) if not o.startswith("pipeline.")])
    name = f"single-{shape.stages}"
    (root / f"{name}.toml").write_text(cfg.to_toml())
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = root / f"{name}-run"
    subprocess.run([sys.executable, "-m", "murmur.cli", "train", "--config", str(root / f"{name}.toml"), "--device",
                    "cpu", "--out", str(out)], check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


# name: (shape, cap x full_state_mb, run_row's keywords); --rows picks them by their key
ROWS = {
    "loss": ("no kills", TINY, CAP, {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False}),
    "kills": ("kills at MTBF 30 s", TINY, CAP, {"peers_per_stage": 2, "mtbf_s": 30.0, "kill_all": False}),
    "resume": ("all killed at once, resumed", TINY, CAP, {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": True}),
    "memory": (f"memory: {MEMORY_STAGES} stages of one peer, a model whose state dwarfs a process", MEMORY, CAP,
               {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False, "drivers": 2}),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120, help="run steps of the loss and churn rows")
    ap.add_argument("--memory-steps", type=int, default=4, help="run steps of the memory row")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"which rows, comma-separated, of {', '.join(ROWS)} (default: all)")
    ap.add_argument("--work", default="/tmp/murmur-pipeline-train")
    ap.add_argument("--results", default=str(RESULTS / "pipeline_train.json"))
    args = ap.parse_args()
    picked = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in picked if r not in ROWS]
    if unknown or not picked:
        ap.error(f"--rows: {', '.join(unknown) or 'none given'}: pick among {', '.join(ROWS)}")
    torch.set_num_threads(1)
    work = Path(args.work)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    data = work / "data"
    prepare(data, tokenizer="byte", shard_tokens=1 << 14)
    load0 = os.getloadavg()
    t0 = time.time()
    singles: dict[int, float] = {}  # id(shape): its `murmur train` val loss
    rows = []
    for key in picked:
        name, shape, cap, kw = ROWS[key]
        steps = args.memory_steps if shape is MEMORY else args.steps
        batches = eval_batches(Dataset.open(data), 4, shape.seq_len, 8)
        if id(shape) not in singles:
            singles[id(shape)] = val_of(load_source(single(work, data, steps, shape)), batches)
        single_val = singles[id(shape)]
        row = run_row(work / key, data, steps, shape=shape, seed=len(rows), **kw)
        source = row.pop("_source")
        params = sum(t.numel() for t in source.weights.values())
        full = params * 16 / 2**20
        val = val_of(source, batches)
        del source
        rows.append({
            "row": name, "stages": row["stages"], "peers_per_stage": row["peers_per_stage"], "params_total": params,
            "full_state_mb": round(full, 2), "peer_cap_mb": round(cap * full, 2),
            "peer_peak_rss_mb_max": row["peer_peak_rss_mb_max"],
            "under_cap": row["peer_peak_rss_mb_max"] <= cap * full < full,
            "peer_peak_of_full": round(row["peer_peak_rss_mb_max"] / full, 3),
            **{k: row[k] for k in ("peer_peak_rss_mb", "peer_base_rss_mb", "peer_peak_over_base_mb_max")},
            "samples": row["samples"], "val_loss_pipeline": round(val, 4), "val_loss_single": round(single_val, 4),
            # only at equal samples: two drivers may overshoot the schedule (samples_committed)
            "equal_samples": row["samples_committed"] == row["samples"],
            "loss_gap_pct": round(100 * (val - single_val) / single_val, 2)
            if row["samples_committed"] == row["samples"] else None,
            **{k: row[k] for k in ("mtbf_s", "kills", "longest_stall_s", "microbatches_lost",
                                   "resumed_from_checkpoint", "drivers", "microbatches_done", "samples_committed",
                                   "loss_first", "loss_last", "tokens_ledger", "driver_exit", "driver_reason", "wall_s",
                                   "peer_rss_detail")},
            "model": shape.model,
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
        "memory_cap": "measured, not enforced: each stage peer's VmHWM (its whole process, the interpreter, torch "
                      "and grpc included) at its clean stop, against peer_cap_mb = "
                      f"{CAP} x full_state_mb",
        "rows": rows,
    }
    Path(args.results).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
