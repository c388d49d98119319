"""A stage peer's memory with the shipped fault tolerance on, against `murmur train` of the whole model.

A real pipelined run on this machine's CPU: a coordinator, S stage peers of one peer a stage (each
with its state folder, so it checkpoints), one driver, the run config of configs/pipeline-cpu.toml
with the model swapped for --dim/--n-layers/--hidden-dim (byte vocabulary, embeddings untied) and
everything else as shipped: the within-stage sync every ``sync_every_samples``, a replica of the next
stage every ``replica_every_s``, checkpoints every ``checkpoint_every_s`` and at the stop (or, with
``--settings off``, all three off). The driver trains --steps run steps; then every peer is stopped
(SIGTERM: it writes its last checkpoint) and reports its peak resident memory (VmHWM of its own
/proc/self/status, its whole life: the interpreter, torch and grpc included). Then `murmur train`
trains the same model (tied as the pipeline is: untied) on the same batch for --single-steps steps
while this script reads its VmHWM from /proc/<pid>/status.

    nice .venv/bin/python benchmarks/peer_memory.py            # the issue's 84.4M model, 4 stages
    nice .venv/bin/python benchmarks/peer_memory.py --settings off --results /tmp/off.json
    nice .venv/bin/python benchmarks/peer_memory.py --peers-per-stage 2   # stage-mates that sync

Writes benchmarks/results/peer_memory.json: device, date, load, command, commit, and one row per
run with ``stage_state_mb`` (the largest stage's weights + gradients + AdamW's two moments, fp32),
``base_rss_mb`` (a peer's resident memory before any of the model: the interpreter, torch, grpc),
``peer_peak_rss_mb_max`` (the largest peer peak), ``peer_over_base_of_state`` ((peak - base) / stage
state of that peer, the issue's target <= 1.5), ``single_peak_rss_mb`` (`murmur train`'s peak) and
``peer_of_single`` (the largest peer peak / single peak, target <= 0.45), with each peer's detail.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from rss_peak import watch_peak  # noqa: E402 - the memory benchmarks' one sampler

RESULTS = REPO / "benchmarks" / "results" / "peer_memory.json"
MIB = 1 << 20
OFF = ("pipeline.sync_every_s=0.0", "pipeline.replica_every_s=0.0", "pipeline.checkpoint_every_s=0.0")


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MURMUR_WARM_START="0")


class Proc:
    """A process whose JSON lines on stdout are collected by a thread."""

    def __init__(self, module: str, args: list[str], log: Path) -> None:
        self.err = open(log, "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=self.err,
                                     env=env(), text=True, start_new_session=True, cwd=REPO)
        self.records: list[dict] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.records.append(r)
            if r.get("event") == "ready":
                self.ready.set()

    def of(self, event: str) -> list[dict]:
        return [r for r in self.records if r.get("event") == event]

    def wait_ready(self, timeout: float = 600) -> dict:
        end = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"a process did not get ready (rc {self.proc.poll()}); see {self.err.name}")
        return self.of("ready")[-1]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 300) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def model_overrides(args) -> list[str]:
    return [f"model.dim={args.dim}", f"model.n_layers={args.n_layers}", f"model.n_heads={args.n_heads}",
            f"model.n_kv_heads={args.n_heads}", f"model.hidden_dim={args.hidden_dim}", f"model.seq_len={args.seq_len}"]


def run_pipeline(work: Path, data: Path, args) -> dict:
    from murmur.node.testnet.procs import Testnet
    from murmur.protocol.runconfig import load_config

    sets = [f'data.path="{data}"', *model_overrides(args), f"train.steps={args.steps}",
            f"train.batch_size={args.batch_size}", "train.eval_every=1000000", f"pipeline.stages={args.stages}",
            f"pipeline.microbatch_size={args.microbatch}", "pipeline.hop_timeout_s=300.0",
            "pipeline.min_hop_timeout_s=60.0", "pipeline.rebalance_every_s=3600.0",
            *(OFF if args.settings == "off" else ()),
            *([f"pipeline.sync_bucket_mb={args.sync_bucket_mb}"] if args.sync_bucket_mb is not None else [])]
    cfg = load_config(REPO / "configs" / "pipeline-cpu.toml", sets)
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.toml").write_text(cfg.to_toml())
    net = Testnet(root=work, config_path=work / "run.toml", data=data, coordinator_args=["--restart-grace", "1"])
    peers: list[Proc] = []
    driver = None
    t0 = time.time()
    try:
        net.start_coordinator()
        join = [str(net.info["address"]), net.create_run(100)]
        for i in range(args.stages * args.peers_per_stage):  # one at a time: each joins the emptiest stage
            peers.append(Proc("murmur.node.pipeline.stage_peer_process",
                              ["--coordinator", join[0], "--token", join[1], "--state-dir", str(work / f"peer-{i}"),
                               "--progress-every", "0"], work / f"peer-{i}.log"))
            peers[-1].wait_ready()
        driver = Proc("murmur.node.pipeline.driver_process",
                      ["--coordinator", join[0], "--token", join[1], "--data", str(data),
                       "--state-dir", str(work / "driver")], work / "driver.log")
        driver.proc.wait(args.timeout)
        for p in peers:
            p.proc.send_signal(signal.SIGTERM)
        for p in peers:
            p.stop()
    finally:
        for p in [*peers, *([driver] if driver else [])]:
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        net.stop_coordinator()
    detail = []
    for p in peers:
        r, s = p.of("ready")[-1], p.of("stopped")[-1]
        state_mb = 4 * r["stage_param_mb"]  # fp32 weights + gradients + AdamW's two moments
        detail.append({"stage": r["stage"], "stage_param_mb": r["stage_param_mb"], "stage_state_mb": round(state_mb, 1),
                       "start_rss_mb": r["start_rss_mb"], "built_peak_rss_mb": r["built_peak_rss_mb"],
                       "peak_rss_mb": s["peak_rss_mb"], "over_base_of_state":
                       round((s["peak_rss_mb"] - r["start_rss_mb"]) / state_mb, 3),
                       "optimizer_steps": s["optimizer_steps"], "checkpoints_written": s["checkpoints_written"],
                       "sync_rounds": s["sync_rounds"], "state_copies": s.get("state_copies"),
                       "state_copied_mb_max": s.get("state_copied_mb_max"),
                       "sync_idle_rounds": s.get("sync_idle_rounds"), "sync_failed": s.get("sync_failed"),
                       "sync_holds_state": s.get("sync_holds_state"),
                       "sync_round_peak_mb": s.get("sync_round_peak_mb"), "sync_parts": s.get("sync_parts"),
                       "final_sync_members": s.get("final_sync_members"),
                       "final_sync_completed": s.get("final_sync_completed"),
                       "final_sync_seconds": s.get("final_sync_seconds"), "state_hash": s.get("state_hash")})
    mbs = driver.of("microbatch") if driver else []
    losses = [r["loss"] for r in mbs if r.get("loss") is not None]
    return {"detail": detail, "sync_bucket_mb": cfg.pipeline.sync_bucket_mb,
            "driver_exit": driver.proc.returncode if driver else None,
            "microbatches": len(mbs), "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "wall_s": round(time.time() - t0, 1)}


def run_single(work: Path, data: Path, args) -> float:
    """`murmur train` of the whole model (untied, as the pipeline's), its VmHWM read from outside."""
    from murmur.protocol.runconfig import load_config

    sets = [f'data.path="{data}"', *model_overrides(args), f"train.steps={args.single_steps}",
            f"train.batch_size={args.batch_size}", "train.eval_every=1000000", "model.tie_embeddings=false"]
    try:
        cfg = load_config(REPO / "configs" / "small-cpu.toml", sets)
    except Exception:  # noqa: BLE001 - a tree without model.tie_embeddings: the preset's tying
        cfg = load_config(REPO / "configs" / "small-cpu.toml", sets[:-1])
    (work / "single.toml").write_text(cfg.to_toml())
    log = open(work / "single.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "murmur.cli", "train", "--config", str(work / "single.toml"),
                             "--device", "cpu", "--out", str(work / "single-run")], stdout=log, stderr=log, env=env(),
                            cwd=REPO)
    peak = [0.0]
    sampler = watch_peak(proc, peak, every_s=0.05)
    proc.wait()
    sampler.join()  # its last reading in
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"murmur train failed ({proc.returncode}); see {work / 'single.log'}")
    return peak[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--hidden-dim", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=32, help="short: the weights, not the activations, are measured")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per run step")
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="run steps the driver trains")
    ap.add_argument("--single-steps", type=int, default=8, help="`murmur train` steps")
    ap.add_argument("--peers-per-stage", type=int, default=1,
                    help="stage peers a stage (2: stage-mates that sync every pipeline.sync_every_samples)")
    ap.add_argument("--settings", choices=("shipped", "off"), default="shipped",
                    help="sync, replica and checkpoints as configs/pipeline-cpu.toml ships them, or all off")
    ap.add_argument("--sync-bucket-mb", type=float, default=None,
                    help="pipeline.sync_bucket_mb (default: as shipped; 0: each round one exchange of the whole stage)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="the driver's whole run, at most")
    ap.add_argument("--work", default="/tmp/murmur-peer-memory")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()

    from murmur.node.model.data import prepare
    from murmur.node.pipeline.config import pipeline_model_config

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "data"
    prepare(data, tokenizer="byte", shard_tokens=1 << 14)
    load0 = os.getloadavg()
    t0 = time.time()
    pipe = run_pipeline(work / "pipeline", data, args)
    single_peak = run_single(work, data, args)
    cfg = pipeline_model_config("tiny", args.stages, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                                n_kv_heads=args.n_heads, hidden_dim=args.hidden_dim, seq_len=args.seq_len,
                                vocab_size=256)
    detail = pipe.pop("detail")
    worst = max(detail, key=lambda d: d["over_base_of_state"])
    peak_max = max(d["peak_rss_mb"] for d in detail)
    row = {
        "stages": args.stages, "peers_per_stage": args.peers_per_stage, "settings": args.settings,
        "params_total": cfg.num_params(),
        "stage_state_mb": max(d["stage_state_mb"] for d in detail),
        "base_rss_mb": max(d["start_rss_mb"] for d in detail),
        "peer_peak_rss_mb_max": peak_max, "single_peak_rss_mb": round(single_peak, 1),
        "peer_over_base_of_state": worst["over_base_of_state"],
        "peer_of_single": round(peak_max / single_peak, 3),
        "targets": {"peer_over_base_of_state": 1.5, "peer_of_single": 0.45},
        "model": {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "hidden_dim": args.hidden_dim,
                  "seq_len": args.seq_len, "vocab": 256, "tie_embeddings": False},
        "batch_size": args.batch_size, "microbatch": args.microbatch, "steps": args.steps,
        "single_steps": args.single_steps, **pipe, "peers": detail,
    }
    if args.peers_per_stage > 1:  # the last sync round at the stop: one state a stage (node/pipeline/stop_sync.py)
        row["stage_mates_agree_at_stop"] = all(
            len({d["state_hash"] for d in detail if d["stage"] == s}) == 1 for s in range(args.stages))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=REPO).stdout)
    out = {"benchmark": "peer_memory", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": f"cpu ({os.cpu_count()} cores), shared", "command": "python3 benchmarks/peer_memory.py "
           + " ".join(sys.argv[1:]), "commit": commit, "tree_dirty": dirty,
           "load_avg_at_start": [round(x, 2) for x in load0],
           "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - t0, 1),
           "peaks": "VmHWM: a peer's own /proc/self/status at its clean stop (checkpoint at the stop included); "
                    "murmur train's read from /proc/<pid>/status every 50 ms while it ran",
           "rows": [row]}
    path = Path(args.results)
    if path.exists() and path.resolve() == RESULTS.resolve():  # keep the other settings' rows
        old = json.loads(path.read_text())
        out["rows"] = [r for r in old.get("rows", []) if (r.get("settings"), r.get("peers_per_stage", 1))
                       != (args.settings, args.peers_per_stage)] + out["rows"]
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(row, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
