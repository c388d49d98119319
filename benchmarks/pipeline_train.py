"""Pipelined training end to end, on this machine's CPU: val loss against `murmur train` of the same
model at equal samples, memory per peer against the whole model's training state, stage peers
SIGKILLed at an MTBF, and a run whose every process is SIGKILLed at once and restarted from the
stage checkpoints.

    nice .venv/bin/python benchmarks/pipeline_train.py     # every row -> benchmarks/results/pipeline_train.json
    nice .venv/bin/python benchmarks/pipeline_train.py --rows loss,loss_2peers,loss_c1   # the loss rows only

``--rows`` picks rows by key (comma-separated): ``loss`` (one peer a stage, the driver's default
microbatches in flight), ``loss_2peers`` (two peers a stage), ``loss_2peers_diloco`` and
``loss_2peers_t8`` (two peers a stage with DiLoCo's outer step in the within-stage sync, at half
and at the whole batch a peer), ``loss_c1`` (one microbatch in flight), ``kills``
(MTBF 30 s), ``resume`` (all killed at once), ``memory``, ``memory_4stages`` (the same model in
4 stages, every pipeline setting as shipped: the issue's target). The results file gets the rows
run; rows
of the file's earlier run whose key was not run are kept, each with the run that measured it
(``measured_by``), so rerunning some rows keeps the others. Each row is a real coordinator, stage
peers and drivers as processes on loopback, training for a number of run steps of
``train.batch_size`` sequences (the same samples, in the ledger's shard order), then:

- the loss rows (``loss*``): the like-for-like comparison. Both sides train the same untied model
  (``model.tie_embeddings = false``; ``tie_embeddings`` in each row), with the same lr schedule,
  batch, samples and eval batches; the pipeline with its settings as shipped (``settings``:
  within-stage sync every ``pipeline.sync_every_samples`` of the run's samples, replicas every
  10 s, checkpoints every 60 s and at the stop, bf16 activations; ``--sync-every-samples N``
  tries another sync period, and the row says so in ``settings``), 2 stages, one driver at
  ``concurrency`` microbatches in flight (the top-level
  ``default_concurrency`` is the driver's default, node/pipeline/driver.py). With two peers a
  stage ``pipeline.target_samples`` (per peer) is half the run's batch, so the stage takes the
  run's steps, and the within-stage sync averages the mates as the pipelined configs ship it
  (``sync.outer_lr`` 1, ``sync.outer_momentum`` 0). ``stage_state_mb``: the largest stage's
  weights, gradients and AdamW moments (16 bytes a parameter); ``base_rss_mb``: a stage peer's
  resident memory before any of the model;
  ``peer_peak_rss_mb_max``: the largest stage peer's peak (VmHWM, as it reports at its clean
  stop; ``peer_peak_rss_mb_outside_max``: the same read from /proc by this script while the
  peers ran); ``single_peak_rss_mb``: `murmur train`'s VmHWM, read from /proc.
- every row but ``memory``: a small Llama-style model (1.9M parameters), 2 stages, one driver,
  ``--steps`` run steps of 8 sequences of 64 tokens (``kills`` and ``resume``: fp32 activations
  and short checkpoint, replica and sync periods).
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
- ``mtbf_s``/``kills``: stage peers (2 a stage) SIGKILLed, the first once a quarter of the schedule
  is in the ledger, then at exponential intervals with that mean, and restarted with their state
  folder, which keeps their identity: each comes back as the same node, and the coordinator replaces
  its entry at its first heartbeat (rows from before the stage peers kept their identity restarted
  each as a new node, its dead entry listed until the heartbeat TTL);
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
import dataclasses
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
from murmur.node.model.stages import split_layers
from murmur.node.pipeline import stage_checkpoint
from murmur.node.pipeline.driver import DEFAULT_CONCURRENCY
from murmur.node.testnet.procs import Testnet, wait_for
from murmur.protocol.runconfig import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rss_peak import watch_peak  # noqa: E402 - the memory benchmarks' one sampler

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
                       "pipeline.hop_timeout_s=30.0", "pipeline.activation_codec=fp32",
                       # the churn rows' sync as they measured it: on the clock, every 5 s
                       "pipeline.sync_every_samples=0"))
# The memory row: a model whose training state (16 bytes a parameter) dwarfs what a process pays
# before any model (~250 MB: the interpreter, torch, grpc), cut in MEMORY_STAGES stages of one peer
# each; short sequences and microbatches so that a few steps fit minutes of this CPU.
MEMORY_STAGES = 8
MEMORY = Shape({"dim": 1024, "n_layers": 16, "n_heads": 8, "n_kv_heads": 8, "hidden_dim": 2048, "seq_len": 32},
               stages=MEMORY_STAGES, batch_size=4, microbatch=2,
               pipeline=("pipeline.checkpoint_every_s=30.0", "pipeline.sync_every_s=0.0",
                         "pipeline.replica_every_s=10.0", "pipeline.hop_timeout_s=300.0",
                         "pipeline.min_hop_timeout_s=60.0", "pipeline.activation_codec=fp32"))
# The memory target, as a volunteer runs it: MEMORY's model in 4 stages of one peer (4 blocks a
# peer), every pipeline setting as shipped (within-stage sync every pipeline.sync_every_samples,
# replicas every 10 s, checkpoints every 60 s and at the stop, bf16 activations); only the hop timeouts are longer, for
# the first microbatches through this CPU's stages (they hold no memory).
MEMORY_4 = Shape(MEMORY.model, stages=4, batch_size=4, microbatch=2,
                 pipeline=("pipeline.hop_timeout_s=300.0", "pipeline.min_hop_timeout_s=60.0"))
# The like-for-like loss rows: TINY's model and cut with the pipeline's settings as shipped (the
# within-stage sync every pipeline.sync_every_samples, replicas every 10 s, checkpoints every 60 s
# and at the stop, bf16 activations): only the shape and the schedule are the benchmark's.
SHIPPED = Shape(TINY.model, stages=2, batch_size=8, microbatch=4)
# Two peers a stage: pipeline.target_samples is per peer, so each peer of a stage steps at half the
# run's batch and the stage takes the run's steps (each peer sees half the microbatches). The
# within-stage sync as configs/pipeline-cpu.toml and pipeline-gpu.toml ship it: plain averaging of
# the mates (sync.outer_lr 1, no outer momentum).
PLAIN_AVERAGE = ("sync.outer_lr=1.0", "sync.outer_momentum=0.0")
SHIPPED_2 = Shape(TINY.model, stages=2, batch_size=8, microbatch=4,
                  pipeline=("pipeline.target_samples=4", *PLAIN_AVERAGE))
# The same with the sync's outer step a data-parallel DiLoCo run uses (testnet-tiny's outer lr 0.7,
# Nesterov momentum 0.9: what the pipelined configs shipped before), at half and at the whole batch.
DILOCO = ("sync.outer_lr=0.7", "sync.outer_momentum=0.9")
SHIPPED_2_DILOCO = Shape(TINY.model, stages=2, batch_size=8, microbatch=4,
                         pipeline=("pipeline.target_samples=4", *DILOCO))
SHIPPED_2_DILOCO_T8 = Shape(TINY.model, stages=2, batch_size=8, microbatch=4, pipeline=DILOCO)
# overrides that make a row's pipeline settings other than the shipped ones
NOT_SHIPPED = ("sync_every_s", "replica_every_s", "checkpoint_every_s", *DILOCO)
CAP = 0.75  # peer_cap_mb, x full_state_mb (the memory row's peers peak near 0.52 x: see docs/pipeline.md)


def overrides(shape: Shape, steps: int, data: Path) -> list[str]:
    # Untied embeddings on both sides (model.tie_embeddings): the pipeline's model is untied, and
    # `murmur train` trains exactly that model. The activation codec is the shipped one (bf16).
    return [f'data.path="{data}"', *(f"model.{k}={v}" for k, v in shape.model.items()), "model.tie_embeddings=false",
            f"train.steps={steps}", f"train.batch_size={shape.batch_size}", "train.eval_every=100000",
            "train.eval_batches=4", "optim.lr=3e-3", "optim.warmup_steps=10", f"pipeline.stages={shape.stages}",
            f"pipeline.microbatch_size={shape.microbatch}", f"pipeline.target_samples={shape.batch_size}",
            "pipeline.rebalance_every_s=600.0", *shape.pipeline]


class Proc:
    """A process whose JSON lines on stdout are collected by a thread, and whose peak resident
    memory another thread reads from /proc."""

    def __init__(self, module: str, args: list[str], log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.err = open(log, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                     stderr=self.err, env=env, text=True, start_new_session=True, cwd=REPO)
        self.records: list[dict] = []
        self.ready = threading.Event()
        self.peak = [0.0]  # VmHWM in MB, read from outside
        threading.Thread(target=self._read, daemon=True).start()
        watch_peak(self.proc, self.peak)

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


def start_driver(join: tuple[str, str], data: Path, root: Path, name: str, state: Path,
                 concurrency: int | None = None) -> Proc:
    """A driver with its state folder: restarted with it, it is the same node (its lease is its own).
    ``concurrency`` None: the driver's default microbatches in flight."""
    extra = [] if concurrency is None else ["--concurrency", str(concurrency)]
    return Proc("murmur.node.pipeline.driver_process",
                ["--coordinator", join[0], "--token", join[1], "--data", str(data), "--state-dir", str(state),
                 "--commit-log", str(root / f"{name}.commits"), *extra], root / f"{name}.log")


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
            kill_all: bool, seed: int, drivers: int = 1, concurrency: int | None = None) -> dict:
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
        active = [start_driver(join, data, root, f"driver-{i}", root / f"driver-state-{i}", concurrency)
                  for i in range(drivers)]
        # The first kill once a quarter of the schedule is in the ledger, then at the MTBF: drawn from
        # the start, a row that ran 31 s at MTBF 30 s killed nobody and tested nothing.
        next_kill, first_kill_pending = math.inf, mtbf_s > 0
        killed_all = False
        while any(d.proc.poll() is None for d in active):
            time.sleep(0.5)
            if first_kill_pending and ledger_tokens(net.db) >= schedule_tokens // 4:
                next_kill, first_kill_pending = time.time(), False
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
                active = [start_driver(join, data, root, f"driver-{len(finished) + i}", root / f"driver-state-{i}",
                                       concurrency) for i in range(drivers)]
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
               "stage_param_mb": r["stage_param_mb"], "optimizer_steps": s["optimizer_steps"],
               "outside_peak_rss_mb": round(p.peak[0], 1)}
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
        # the same peaks read from /proc by this process while the peers ran (up to 0.1 s before the exit)
        "peer_peak_rss_mb_outside_max": round(max(p.peak[0] for p in every_peer), 1),
        "peer_peak_over_base_mb_max": round(max(d["stop_peak_rss_mb"] - d["start_rss_mb"] for d in detail), 1),
        "mtbf_s": mtbf_s or None, "kills": kills, "longest_stall_s": round(stall, 2),
        "microbatches_lost": max(0, (schedule_tokens - tokens) // (shape.microbatch * shape.seq_len)),
        "resumed_from_checkpoint": bool(restarts_from_ckpt) and all(restarts_from_ckpt),
        "wall_s": round(wall, 1), "_source": source, "peer_rss_detail": detail,
    }


def single(root: Path, data: Path, steps: int, shape: Shape) -> tuple[Path, float]:
    """`murmur train` of the same run without its [pipeline] section (the same untied model, lr
    schedule, batch and data) in one process: its output folder and its peak RSS, read from /proc."""
    cfg = load_config(REPO / "configs" / "testnet-tiny.toml",
                      [o for o in overrides(shape, steps, data) if not o.startswith("pipeline.")])
    name = f"single-{shape.model['n_layers']}x{shape.model['dim']}-{steps}"
    (root / f"{name}.toml").write_text(cfg.to_toml())
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = root / f"{name}-run"
    proc = subprocess.Popen([sys.executable, "-m", "murmur.cli", "train", "--config", str(root / f"{name}.toml"),
                             "--device", "cpu", "--out", str(out)], env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    peak = [0.0]
    sampler = watch_peak(proc, peak)
    if proc.wait() != 0:
        raise RuntimeError(f"murmur train failed (rc {proc.returncode})")
    sampler.join()  # its last reading in
    return out, round(peak[0], 1)


def stage_state_mb(weights: dict[str, torch.Tensor], n_layers: int, stages: int) -> float:
    """The largest stage's training state: its weights, gradients and AdamW's two moments (fp32,
    16 bytes a parameter), with the embedding on stage 0 and the final norm and head on the last."""
    spans = split_layers(n_layers, stages)
    per = [0] * stages
    for name, t in weights.items():
        if name.startswith("blocks."):
            block = int(name.split(".")[1])
            stage = next(sp.index for sp in spans if block in sp.blocks)
        else:
            stage = 0 if name.startswith("embed") else stages - 1
        per[stage] += t.numel()
    return round(max(per) * 16 / 2**20, 2)


# key: (name, shape, cap x full_state_mb, run_row's keywords); --rows picks them by their key.
# concurrency None: the driver's default (DEFAULT_CONCURRENCY), as a volunteer's driver runs.
ROWS = {
    "loss": ("like for like, 1 peer a stage, default concurrency", SHIPPED, CAP,
             {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False}),
    "loss_2peers": ("like for like, 2 peers a stage, default concurrency", SHIPPED_2, CAP,
                    {"peers_per_stage": 2, "mtbf_s": 0.0, "kill_all": False}),
    "loss_2peers_diloco": ("2 peers a stage, the sync's outer step DiLoCo's (0.7, Nesterov 0.9)", SHIPPED_2_DILOCO,
                           CAP, {"peers_per_stage": 2, "mtbf_s": 0.0, "kill_all": False}),
    "loss_2peers_t8": ("2 peers a stage, each stepping at the run's whole batch, DiLoCo's outer step",
                       SHIPPED_2_DILOCO_T8, CAP, {"peers_per_stage": 2, "mtbf_s": 0.0, "kill_all": False}),
    "loss_c1": ("like for like, 1 peer a stage, 1 microbatch in flight", SHIPPED, CAP,
                {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False, "concurrency": 1}),
    "kills": ("kills at MTBF 30 s", TINY, CAP, {"peers_per_stage": 2, "mtbf_s": 30.0, "kill_all": False}),
    "resume": ("all killed at once, resumed", TINY, CAP, {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": True}),
    "memory": (f"memory: {MEMORY_STAGES} stages of one peer, a model whose state dwarfs a process", MEMORY, CAP,
               {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False, "drivers": 2}),
    "memory_4stages": ("memory: 4 stages of one peer, shipped settings (the issue's target)", MEMORY_4, CAP,
                       {"peers_per_stage": 1, "mtbf_s": 0.0, "kill_all": False, "drivers": 2}),
}


def carried(results: Path, picked: list[str]) -> list[dict]:
    """The rows of ``results`` (an earlier run) whose key this run did not run, each marked with the
    run that measured it: `--rows loss` leaves the memory row, which takes far longer, as it was.
    Rows from before the like-for-like loss rows carry no key; of those only the memory row, whose
    figures do not depend on the loss rows' settings, is kept."""
    if not results.exists():
        return []
    old = json.loads(results.read_text())
    keep = []
    for r in old.get("rows", []):
        key = r.get("key") or ("memory" if str(r.get("row", "")).startswith("memory") else None)
        if key is None or key in picked:
            continue
        keep.append({**r, "key": key, "measured_by": r.get("measured_by") or {
            k: old.get(k) for k in ("date", "commit", "command", "load_avg_at_start", "load_avg_at_end")}})
    return keep


def gpu_row(path: Path) -> list[dict]:
    """The row of the GPU run (benchmarks/pipeline_gpu.py, which only a GPU machine runs: its own
    results file is the record), in this file's terms: each stage peer's GPU memory against its
    share, and the driver's loss."""
    if not path.is_file():
        return []
    g = json.loads(path.read_text())
    peers = [p for p in g["peers"] if p.get("gpu_peak_mb")]
    if not peers:
        return []
    drivers = g.get("drivers") or [{}]
    return [{
        "key": "gpu", "row": f"{len(peers)} stages of one peer on one GPU, shipped settings ({Path(g['config']).name})",
        "stages": len(peers), "peers_per_stage": 1, "concurrency": DEFAULT_CONCURRENCY, "device": g["device"],
        "settings": "shipped, but for " + " ".join(g["overrides"]),
        "stage_state_mb": max(p["stage_state_mb"] for p in peers),
        "gpu_peak_of_share": [p["gpu_peak_of_share"] for p in peers],
        "smi_peak_of_share": [p.get("smi_peak_of_share") for p in peers],
        "microbatches": drivers[0].get("microbatches"), "loss_first": drivers[0].get("first_loss"),
        "loss_last": drivers[0].get("last_loss"), "loss_fell": g.get("loss_fell"),
        "measured_by": {k: g.get(k) for k in ("date", "commit", "command")},
        "source": f"benchmarks/results/{path.name}",
    }]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120, help="run steps of the loss and churn rows")
    ap.add_argument("--memory-steps", type=int, default=4, help="run steps of the memory row")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"which rows, comma-separated, of {', '.join(ROWS)} (default: all)")
    ap.add_argument("--work", default="/tmp/murmur-pipeline-train")
    ap.add_argument("--results", default=str(RESULTS / "pipeline_train.json"))
    ap.add_argument("--gpu-results", default=str(RESULTS / "pipeline_gpu.json"),
                    help="benchmarks/pipeline_gpu.py's results: its figures become the row 'gpu' (none: no row)")
    ap.add_argument("--sync-every-samples", type=int, default=None,
                    help="the loss rows' pipeline.sync_every_samples instead of the shipped one (to pick it)")
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
    singles: dict[tuple, tuple[float, float]] = {}  # its `murmur train` val loss and peak RSS
    rows = []
    for key in picked:
        name, shape, cap, kw = ROWS[key]
        if args.sync_every_samples is not None and key.startswith("loss"):
            shape = dataclasses.replace(
                shape, pipeline=(*shape.pipeline, f"pipeline.sync_every_samples={args.sync_every_samples}"))
        steps = args.memory_steps if shape.model is MEMORY.model else args.steps
        batches = eval_batches(Dataset.open(data), 4, shape.seq_len, 8)
        one = (tuple(shape.model.items()), shape.batch_size, steps)  # what `murmur train` trains (no pipeline.*)
        if one not in singles:
            out, single_peak = single(work, data, steps, shape)
            singles[one] = (val_of(load_source(out), batches), single_peak)
        single_val, single_peak = singles[one]
        load_row = os.getloadavg()
        row = run_row(work / key, data, steps, shape=shape, seed=len(rows), **kw)
        source = row.pop("_source")
        params = sum(t.numel() for t in source.weights.values())
        full = params * 16 / 2**20
        val = val_of(source, batches)
        state_mb = stage_state_mb(source.weights, shape.model["n_layers"], shape.stages)
        del source
        rows.append({
            "key": key, "row": name, "stages": row["stages"], "peers_per_stage": row["peers_per_stage"],
            "concurrency": kw.get("concurrency") or DEFAULT_CONCURRENCY, "tie_embeddings": False,
            "settings": "benchmark's: " + " ".join(shape.pipeline)
            if any(k in o for o in shape.pipeline for k in NOT_SHIPPED) else "shipped",
            "target_samples": next((int(o.split("=")[1]) for o in shape.pipeline[::-1] if "target_samples" in o),
                                   shape.batch_size),
            "activation_codec": next((o.split("=")[1] for o in shape.pipeline if "activation_codec" in o), "bf16"),
            "params_total": params, "stage_state_mb": state_mb, "base_rss_mb": row["peer_base_rss_mb"],
            "peer_peak_rss_mb_max": row["peer_peak_rss_mb_max"], "single_peak_rss_mb": single_peak,
            "samples": row["samples"], "val_loss_pipeline": round(val, 4), "val_loss_single": round(single_val, 4),
            # only at equal samples: two drivers may overshoot the schedule (samples_committed)
            "equal_samples": row["samples_committed"] == row["samples"],
            "loss_gap_pct": round(100 * (val - single_val) / single_val, 2)
            if row["samples_committed"] == row["samples"] else None,
            "full_state_mb": round(full, 2), "peer_cap_mb": round(cap * full, 2),
            "under_cap": row["peer_peak_rss_mb_max"] <= cap * full < full,
            "peer_peak_of_full": round(row["peer_peak_rss_mb_max"] / full, 3),
            **{k: row[k] for k in ("peer_peak_rss_mb", "peer_peak_rss_mb_outside_max", "peer_base_rss_mb",
                                   "peer_peak_over_base_mb_max")},
            **{k: row[k] for k in ("mtbf_s", "kills", "longest_stall_s", "microbatches_lost",
                                   "resumed_from_checkpoint", "drivers", "microbatches_done", "samples_committed",
                                   "loss_first", "loss_last", "tokens_ledger", "driver_exit", "driver_reason", "wall_s",
                                   "peer_rss_detail")},
            "load_avg_at_row_start": [round(x, 2) for x in load_row],
            "load_avg_at_row_end": [round(x, 2) for x in os.getloadavg()],
            "model": shape.model,
        })
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO).stdout)
    out = {
        "benchmark": "pipeline_train",
        # the driver's microbatches in flight unless told otherwise (node/pipeline/driver.py): the loss
        # rows' concurrency, and the one benchmarks/pipeline.py's efficiency is stated at
        "default_concurrency": DEFAULT_CONCURRENCY,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"cpu ({os.cpu_count()} cores)", "command": "python3 benchmarks/pipeline_train.py "
        + " ".join(sys.argv[1:]), "commit": commit, "tree_dirty": dirty,
        "load_avg_at_start": [round(x, 2) for x in load0], "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.time() - t0, 1),
        "loss_gap_targets_pct": {"1 peer a stage": 2.0, "2 peers a stage": 3.0},
        "memory_cap": "measured, not enforced: each stage peer's VmHWM (its whole process, the interpreter, torch "
                      "and grpc included) at its clean stop, against peer_cap_mb = "
                      f"{CAP} x full_state_mb; single_peak_rss_mb: `murmur train`'s VmHWM read from /proc",
        "rows": rows + carried(Path(args.results), [*picked, "gpu"]) + gpu_row(Path(args.gpu_results)),
    }
    Path(args.results).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
