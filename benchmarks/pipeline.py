"""Benchmark: pipeline training over shaped links, with and without stage peers being killed.

    sudo .venv/bin/python benchmarks/pipeline.py [--stages 2] [--peers-per-stage 2] \
        [--rates 1000,100,20] [--codecs bf16,int8] [--mtbf 0,30] [--microbatches 120] \
        [--kill-microbatches 400] [--concurrency 4,8]

Every process (S x P stage peers, `python -m murmur.node.pipeline.stage_peer_process`, and one
driver, `python -m murmur.node.pipeline.driver_process`) runs in its own network namespace on one
bridge, its upload shaped by ``tc tbf`` to the link rate (the namespaces and shaping of
benchmarks/exchange.py, reused; do not run both at once). The model is the tiny preset (4 blocks,
dim 128, seq 128) cut into S stages, microbatches of 4 rows.

With ``mtbf_s > 0`` a chaos thread gives every stage peer an exponential lifetime of mean
``mtbf_s``; a peer that dies (SIGKILL) is restarted at once on the same stage (a fresh process
that must import torch and build its stage before it serves) and the peer list the driver re-reads
each second is rewritten when it is ready. Rows:

  stages, peers_per_stage, link_mbps, activation_codec, mtbf_s, kills, concurrency (microbatches
  the driver keeps in flight), samples_per_s (rows the driver completed and committed per second
  of its run), ideal_samples_per_s (the slowest stage's measured compute: per stage, the peers'
  CPU seconds per sample of forward, backward, gradient accumulation and optimizer steps, from the
  peers that stopped cleanly, with P peers working in parallel; and no more than
  cores_samples_per_s, every stage's CPU per sample spread over the machine's cores),
  efficiency (samples_per_s / ideal_samples_per_s), bytes_per_sample (wire bytes of the hops that
  succeeded, both ways, per row), microbatches_lost (asked for minus committed: 0 means every
  microbatch was eventually committed, once), retries (hop attempts beyond the first),
  rebalance_recovery_s (in the refill rows: seconds from killing both peers of stage 1 to the
  moved peer serving it, from the ledger's events; with lost_after_s, moved_after_s,
  driver_gap_s, the longest pause of the driver's completions), load (the machine's load
  averages at the end of the row: other jobs share these cores); cpu_ms_per_sample (CPU per
  sample: the stages' computing threads, the stage peers' whole processes from ready to stop, the
  driver's whole process while it drove), cores_samples_per_s_all_cpu (the cores over the stage
  peers' and the driver's CPU per sample: what this machine can do with everything the pipeline
  runs, overheads included) and efficiency_vs_all_cpu (samples_per_s against it: near 1, the
  cores are the limit, not waiting).

Writes benchmarks/results/pipeline.json. Needs root (namespaces) and ip, tc and iptables (checked
first, with a one-line error); cleans up after itself, a row that fails halfway included.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import exchange as shaped  # noqa: E402 - the namespaces and tbf shaping of the exchange benchmark

MODEL = ["--preset", "tiny", "--n-layers", "4", "--dim", "128", "--seq-len", "128", "--seed", "0"]
MICROBATCH = 4
NEEDED_TOOLS = ("ip", "tc", "iptables")  # checked before anything is built
START_TIMEOUT_S = 300


def ip(i: int) -> str:
    return shaped.SUBNET.format(i + 1)


def in_ns(i: int, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", shaped.NS.format(i), *cmd]


def env(threads: int) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))


class Peer:
    def __init__(self, slot: int, stage: int, ident: Path, args: argparse.Namespace) -> None:
        self.slot, self.stage, self.ident, self.args = slot, stage, ident, args
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict = {}
        self.stopped: dict = {}

    def start(self) -> None:
        cmd = in_ns(self.slot, sys.executable, "-m", "murmur.node.pipeline.stage_peer_process",
                    "--identity", str(self.ident), "--run", "bench", "--stage", str(self.stage),
                    "--stages", str(self.args.stages), *MODEL, "--host", ip(self.slot), "--target-samples", "16",
                    "--threads", str(self.args.threads))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env(self.args.threads), cwd=REPO)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: stage peer {self.slot} did not start")
        self.ready = json.loads(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        for line in out.splitlines():
            rec = json.loads(line)
            if rec.get("event") == "stopped":
                self.stopped = rec


def write_peers(path: Path, peers: list[Peer], lock: threading.Lock) -> None:
    with lock:
        live = [p.ready for p in peers if p.ready and p.proc is not None and p.proc.poll() is None]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"peers": [{k: r[k] for k in ("node_id", "address", "stage")} for r in live]}))
        tmp.replace(path)


def chaos(peers: list[Peer], mtbf: float, stop: threading.Event, path: Path, lock: threading.Lock,
          kills: list[float]) -> None:
    """Kill each peer after an exponential lifetime and restart it on its stage at once."""
    rng = random.Random(0)
    due = {p.slot: time.monotonic() + rng.expovariate(1 / mtbf) for p in peers}
    while not stop.wait(0.2):
        for p in peers:
            if time.monotonic() < due[p.slot] or stop.is_set():
                continue
            p.kill()
            kills.append(time.monotonic())
            write_peers(path, peers, lock)
            p.start()
            write_peers(path, peers, lock)
            due[p.slot] = time.monotonic() + rng.expovariate(1 / mtbf)


def one_row(args, work: Path, data: Path, rate: int, codec: str, mtbf: float, concurrency: int) -> dict:
    from murmur.protocol.identity import CertificateAuthority

    n_peers = args.stages * args.peers_per_stage
    try:
        shaped.net_up(n_peers + 1, args.congestion)
        shaped.set_rate(n_peers + 1, rate)
    except BaseException:
        shaped.net_down(n_peers + 1)  # a half-built network (bridge, namespaces) is not left behind
        raise
    ca = CertificateAuthority.create("bench")
    row_dir = Path(tempfile.mkdtemp(dir=work))
    for i in range(n_peers + 1):
        ca.issue().save(row_dir / f"id{i}")
    peers = [Peer(1 + i, i // args.peers_per_stage, row_dir / f"id{1 + i}", args) for i in range(n_peers)]
    lock, stop, kills = threading.Lock(), threading.Event(), []
    peers_file = row_dir / "peers.json"
    driver = None
    try:
        threads = [threading.Thread(target=p.start) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(START_TIMEOUT_S)
        write_peers(peers_file, peers, lock)
        count = args.kill_microbatches if mtbf else args.microbatches
        cmd = in_ns(0, sys.executable, "-m", "murmur.node.pipeline.driver_process", "--identity", str(row_dir / "id0"),
                    "--run", "bench", "--peers", str(peers_file), "--stages", str(args.stages), *MODEL,
                    "--data", str(data), "--microbatches", str(count), "--microbatch-size", str(MICROBATCH),
                    "--concurrency", str(concurrency), "--codec", codec, "--hop-timeout-s", "30",
                    "--microbatch-attempts", "20", "--threads", str(args.threads))
        driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env(args.threads), cwd=REPO)
        monkey = None
        if mtbf:
            monkey = threading.Thread(target=chaos, args=(peers, mtbf, stop, peers_file, lock, kills))
            monkey.start()
        out, _ = driver.communicate(timeout=args.row_timeout)
        stop.set()
        if monkey is not None:
            monkey.join()
    finally:
        try:
            stop.set()
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.wait()
            for p in peers:
                p.stop()
                p.kill()
        finally:  # a second signal while the processes stop must not leave the bridge behind
            shaped.net_down(n_peers + 1)
    recs = [json.loads(line) for line in out.splitlines()]
    done = next(r for r in recs if r["event"] == "done")
    retries = sum(r["retries"] for r in recs if r["event"] == "microbatch")
    samples = done["committed_tokens"] / 128  # rows of seq_len 128
    # The ideal: each stage's P peers working in parallel at their measured cost per sample (CPU
    # seconds of the computing thread, which other processes' load does not inflate), and no more
    # than the machine's cores can do: all stages' CPU per sample spread over every core.
    per_stage, cpu_per_sample = [], 0.0
    for s in range(args.stages):
        clean = [p.stopped for p in peers if p.stage == s and p.stopped.get("samples_total")]
        secs = sum(c["cpu_seconds"] for c in clean)
        rows = sum(c["samples_total"] for c in clean)
        per_stage.append(args.peers_per_stage * rows / secs if secs else float("nan"))
        cpu_per_sample += secs / rows if rows else float("nan")
    cores_bound = (os.cpu_count() or 1) / cpu_per_sample
    ideal = min(*per_stage, cores_bound)
    rate_achieved = samples / done["seconds"]
    # Where the machine's CPU went, per sample: the stage peers' whole processes from ready to stop
    # (compute, gRPC, codecs, the event loop) and the driver's while it drove. Here they share the
    # cores, so all of it bounds the rate; a deployment gives each its own machine.
    served = [p for p in peers if p.stopped.get("samples_total") and "process_cpu_seconds" in p.ready]
    peer_cpu = sum(p.stopped["process_cpu_seconds"] - p.ready["process_cpu_seconds"] for p in served)
    peer_rows = sum(p.stopped["samples_total"] for p in served) / args.stages
    ms = {"stage_compute": 1000 * cpu_per_sample,
          "stage_processes": 1000 * peer_cpu / peer_rows if peer_rows else float("nan"),
          "driver": 1000 * done["cpu_seconds"] / max(samples, 1) if "cpu_seconds" in done else float("nan")}
    all_cpu_bound = (os.cpu_count() or 1) / ((ms["stage_processes"] + ms["driver"]) / 1000)
    return {
        "stages": args.stages, "peers_per_stage": args.peers_per_stage, "link_mbps": rate,
        "activation_codec": codec, "mtbf_s": mtbf or None, "kills": len(kills), "concurrency": concurrency,
        "microbatches": count, "samples_per_s": round(rate_achieved, 2),
        "ideal_samples_per_s": round(ideal, 2), "stage_samples_per_s": [round(v, 2) for v in per_stage],
        "cores_samples_per_s": round(cores_bound, 2),
        "efficiency": round(rate_achieved / ideal, 3),
        "cpu_ms_per_sample": {k: round(v, 2) for k, v in ms.items()},
        "cores_samples_per_s_all_cpu": round(all_cpu_bound, 2),
        "efficiency_vs_all_cpu": round(rate_achieved / all_cpu_bound, 3),
        "bytes_per_sample": round(done["wire_bytes"] / max(samples, 1)),
        "microbatches_lost": count - done["committed_end"], "retries": retries,
        "seconds": round(done["seconds"], 1), "rebalance_recovery_s": None, "load": shaped.load(),
    }


RECOVERY_TTL_S = 3.0  # the coordinator's heartbeat TTL in the recovery rows: how soon a dead peer is lost


def recovery_row(args, work: Path, data: Path, repeat: int) -> dict:
    """Both peers of stage 1 SIGKILLed mid-run (loopback, a real coordinator, a pipelined run):
    how long until the coordinator has refilled the stage and it serves again."""
    from murmur.node.testnet.procs import Testnet, stop_process
    from murmur.protocol.runconfig import load_config

    root = work / f"recovery-{repeat}"
    root.mkdir()
    shape = [f"model.{k}={v}" for k, v in (("n_layers", 4), ("dim", 128), ("seq_len", 128), ("hidden_dim", 352))]
    cfg = load_config(REPO / "configs" / "testnet-tiny.toml", [
        f'data.path="{data}"', *shape, "seed=0", "pipeline.stages=2", "pipeline.microbatch_size=4",
        "pipeline.target_samples=16", "pipeline.microbatch_attempts=8", "pipeline.hop_timeout_s=30.0",
        f"pipeline.rebalance_every_s={args.rebalance_every}", f"pipeline.replica_every_s={args.replica_every}",
        f"pipeline.sync_every_s={args.sync_every}",
        # The driver follows the run's schedule: without this, testnet-tiny's 200 steps ended it at
        # 200 of the --recovery-microbatches asked for, and the row counted 40 as lost.
        f"train.steps={args.recovery_microbatches}",
    ])
    (root / "run.toml").write_text(cfg.to_toml())
    net = Testnet(root=root, config_path=root / "run.toml", data=data, threads=args.threads,
                  coordinator_args=["--heartbeat-ttl", str(RECOVERY_TTL_S), "--restart-grace", "1"])
    info = net.start_coordinator()
    join = ["--coordinator", str(info["address"]), "--token", net.create_run(token_uses=8)]
    peers: list[subprocess.Popen] = []
    ready: list[dict] = []
    driver = None
    try:
        for _ in range(4):
            p = subprocess.Popen([sys.executable, "-m", "murmur.node.pipeline.stage_peer_process", *join, "--threads",
                                  str(args.threads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env=env(args.threads), cwd=REPO)
            peers.append(p)
            while (rec := json.loads(p.stdout.readline() or '{"event": "exit"}'))["event"] not in ("ready", "exit"):
                pass
            ready.append(rec)
        out_path = root / "driver.jsonl"
        with open(out_path, "w") as out:
            driver = subprocess.Popen([sys.executable, "-m", "murmur.node.pipeline.driver_process", *join,
                                       "--data", str(data), "--microbatches", str(args.recovery_microbatches),
                                       "--concurrency", str(args.concurrency[-1]), "--threads", str(args.threads)],
                                      stdout=out, text=True, env=env(args.threads), cwd=REPO)

            def records(kind: str) -> list[dict]:
                return [r for r in map(json.loads, out_path.read_text().splitlines()) if r.get("event") == kind]

            while len(records("microbatch")) < args.recovery_microbatches // 3 and driver.poll() is None:
                time.sleep(0.2)
            while not all(p["report"]["replica_stage"] == 1 for p in net.admin("stages", "--peers")["peers"]
                          if p["report"]["stage"] == 0):
                time.sleep(0.5)
            killed_at = time.time()
            for p, r in zip(peers, ready, strict=True):
                if r.get("stage") == 1:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
            driver.wait(args.row_timeout)
        events = net.admin("events", "--limit", "1000")["events"]
        done = records("done")[0]
        times = sorted(r["at"] for r in records("microbatch"))
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        for p in peers:
            stop_process(p)
        net.stop_coordinator()

    def first(kind: str, **match) -> dict:
        return next(e for e in events if e["kind"] == kind and e["at"] >= killed_at
                    and all(e["detail"].get(k) == v for k, v in match.items()))

    lost, move = first("stage_lost"), first("stage_move")
    serving = next(e for e in events if e["kind"] == "stage_serving" and e["node_id"] == move["node_id"]
                   and e["at"] >= move["at"])
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= killed_at]
    return {
        "stages": 2, "peers_per_stage": 2, "link_mbps": None, "activation_codec": "bf16",
        "mtbf_s": None, "kills": 2, "concurrency": args.concurrency[-1],
        "scenario": "both peers of stage 1 SIGKILLed (loopback, coordinator)",
        "repeat": repeat, "heartbeat_ttl_s": RECOVERY_TTL_S, "rebalance_every_s": args.rebalance_every,
        "replica_every_s": args.replica_every, "sync_every_s": args.sync_every,
        "lost_after_s": round(lost["at"] - killed_at, 2), "moved_after_s": round(move["at"] - killed_at, 2),
        "rebalance_recovery_s": round(serving["at"] - killed_at, 2),
        "state_source": serving["detail"].get("source"),
        "driver_gap_s": round(max(gaps), 2) if gaps else None,
        "microbatches": args.recovery_microbatches,
        "microbatches_lost": args.recovery_microbatches - done["committed_end"], "load": shaped.load(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--peers-per-stage", type=int, default=2)
    ap.add_argument("--rates", default="1000,100,20", help="link rates, Mbit/s")
    ap.add_argument("--codecs", default="bf16,int8")
    ap.add_argument("--mtbf", default="0,30", help="mean seconds between failures per peer (0: none)")
    ap.add_argument("--microbatches", type=int, default=120)
    ap.add_argument("--kill-microbatches", type=int, default=400, help="microbatches of a row with kills")
    ap.add_argument("--concurrency", default="4,8",
                    help="microbatches the driver keeps in flight, a row per value (the refill rows: the last)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--congestion", default="cubic")
    ap.add_argument("--row-timeout", type=float, default=900)
    ap.add_argument("--recovery", type=int, default=3, help="repeats of the stage-refill row (0: none)")
    ap.add_argument("--recovery-microbatches", type=int, default=240)
    ap.add_argument("--rebalance-every", type=float, default=60.0)
    ap.add_argument("--replica-every", type=float, default=5.0)
    ap.add_argument("--sync-every", type=float, default=10.0,
                    help="pipeline.sync_every_s: a sync round's time scale (its deadline is 3/4 of it); the rounds "
                         "themselves go by the run's samples, pipeline.sync_every_samples as shipped")
    ap.add_argument("--out", default=str(HERE / "results" / "pipeline.json"))
    args = ap.parse_args()
    args.concurrency = [int(v) for v in args.concurrency.split(",") if v]
    if os.geteuid() != 0:
        raise SystemExit("error: needs root for network namespaces (sudo)")
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"error: benchmarks/pipeline.py needs {', '.join(missing)} on the PATH (network namespaces, "
                         "link shaping and the bridge's FORWARD rule); e.g. apt-get install iproute2 iptables")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so each row's cleanup runs
    from murmur.node.model.data import prepare

    rows: list[dict] = []
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "pipeline", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "command": " ".join(["benchmarks/pipeline.py", *sys.argv[1:]]), "commit": commit,
        "model": " ".join(MODEL), "microbatch_rows": MICROBATCH, "rows": rows,
    }
    with tempfile.TemporaryDirectory(prefix="murmur-pipe-bench-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        data = work / "data"
        prepare(data, tokenizer="byte", shard_tokens=1 << 20)
        for concurrency in args.concurrency:
            for mtbf in [float(v) for v in args.mtbf.split(",") if v]:
                for rate in [int(v) for v in args.rates.split(",") if v]:
                    for codec in args.codecs.split(","):
                        row = one_row(args, work, data, rate, codec, mtbf, concurrency)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        # after every row, so an interrupted run keeps what it measured
                        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        for repeat in range(args.recovery):
            row = recovery_row(args, work, data, repeat)
            print(json.dumps(row), flush=True)
            rows.append(row)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
