"""`murmur testnet up --stages S`: a pipelined local network, as real processes on loopback.

    murmur testnet up --stages 2 --nodes 4 --drivers 1 --config configs/testnet-tiny.toml --duration 120

The run config gains ``pipeline.stages = S`` (the other ``[pipeline]`` keys: the config's, or
their defaults). The coordinator assigns each of the N stage peers a stage as it joins and
rebalances them; the D drivers lease shard after shard, send microbatches through the stages,
commit the tokens of completed ones and evaluate the validation split every ``train.eval_every``
run steps. Unless ``--set train.steps=N`` is given the run's schedule outlasts ``--duration``,
so the drivers train until the testnet stops them (or the data runs out). A table of the stages
(peers, samples/s, queue, last move) and of the drivers (microbatches committed, loss) is
redrawn every few seconds; at the end everything is stopped with SIGTERM and OUT/summary.json
holds the last view. ``--device`` is every stage peer's (auto: a GPU where there is one, with
bf16 autocast unless the config's train.dtype says fp32); each builds only its stage, there.
Every stage peer and driver keeps its identity in its state folder (OUT/nodes/peer-N/,
OUT/nodes/driver-N/): one restarted by hand with the same command is the same node, needing no
token, and a driver resumes its lease at once. Each stage peer checkpoints its stage into its
folder (``pipeline.checkpoint_every_s`` and at the stop), so `murmur export OUT --out DIR`
assembles the run's model from them.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from murmur.node.testnet.procs import Testnet, TestnetError, _env, start_module, stop_process

VIEW_EVERY_S = 3.0  # each view is one `murmur admin stages` call
READY_TIMEOUT_S = 180.0  # a stage peer imports torch and loads its stage
# The run's schedule unless --set train.steps says otherwise: longer than any --duration, so the
# drivers lease shard after shard until the testnet stops them (or the data runs out).
PIPELINE_TESTNET_STEPS = 10**6


@dataclass(slots=True)
class PipelineProc:
    name: str
    module: str  # run as `python -m module args`
    args: list[str]
    out_path: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    _files: list[IO] = field(default_factory=list)

    def start(self, threads: int) -> None:
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        out, log = open(self.out_path, "ab"), open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._files = [out, log]
        self.proc = start_module(self.module, self.args, env=_env(threads), stdout=out, stderr=log)

    def records(self) -> list[dict]:
        if not self.out_path.is_file():
            return []
        out = []
        for line in self.out_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        code = stop_process(self.proc) if self.proc is not None else None
        for f in self._files:
            f.close()
        return code


def run_pipeline(args, out: Path, config_path: Path, data: Path, coordinator_args: list[str]) -> int:
    net = Testnet(root=out, config_path=config_path, data=data, threads=args.threads,
                  coordinator_args=coordinator_args)
    peers: list[PipelineProc] = []
    drivers: list[PipelineProc] = []
    t0 = time.monotonic()
    view: dict = {}
    try:
        info = net.start_coordinator()
        print(f"coordinator on {info['address']} (ledger {net.db}, admin key {info['admin_key_file']})")
        if info.get("metrics"):
            print(f"status page: http://{info['metrics']}/ (open it while the run lasts)")
        token = net.create_run(token_uses=(args.nodes + args.drivers) * 4)
        join = ["--coordinator", str(info["address"]), "--token", token]
        for i in range(args.nodes):
            p = PipelineProc(f"peer-{i}", "murmur.node.pipeline.stage_peer_process",
                             [*join, "--threads", str(args.threads), "--device", getattr(args, "device", "cpu"),
                              "--state-dir", str(out / "nodes" / f"peer-{i}")],  # `murmur export OUT` reads them
                             out / "nodes" / f"peer-{i}.jsonl", out / "nodes" / f"peer-{i}.log")
            p.start(args.threads)
            peers.append(p)
            _wait_ready(p)  # one at a time: each joins the emptiest stage
        print(f"{args.nodes} stage peers serve {args.stages} stages; logs in {out / 'nodes'}; Ctrl+C stops everything")
        for i in range(args.drivers):
            d = PipelineProc(
                f"driver-{i}",
                "murmur.node.pipeline.driver_process",
                [*join, "--data", str(data), "--threads", str(args.threads),
                 "--commit-log", str(out / "nodes" / f"driver-{i}.commits"),
                 "--state-dir", str(out / "nodes" / f"driver-{i}")],  # restarted with it: the same node
                out / "nodes" / f"driver-{i}.jsonl", out / "nodes" / f"driver-{i}.log",
            )
            d.start(args.threads)
            drivers.append(d)
        # --duration is the drivers' time: the start-up before them (a coordinator, then one stage
        # peer at a time) takes seconds on an idle machine and far more on a loaded one
        training_t0 = time.monotonic()
        while time.monotonic() - training_t0 < args.duration and any(d.alive() for d in drivers):
            time.sleep(VIEW_EVERY_S)
            try:
                view = net.admin("stages")
            except TestnetError as err:
                print(f"(no view: {err})")
                continue
            _show(view, drivers, time.monotonic() - t0)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the drivers and the stage peers")
    finally:
        codes = {d.name: d.stop() for d in drivers}
        codes.update(_stop_together(peers))
        codes["coordinator"] = net.stop_coordinator()
    return _summarize(out, view, drivers, codes, time.monotonic() - t0)


def _stop_together(peers: list[PipelineProc]) -> dict[str, int | None]:
    """SIGTERM every stage peer at once: stage-mates stopped together run one last sync round before
    their final checkpoints (node/pipeline/stop_sync.py); stopped one after another, each found its
    mates still serving and left them out."""
    codes: dict[str, int | None] = {}

    def one(p: PipelineProc) -> None:
        codes[p.name] = p.stop()

    threads = [threading.Thread(target=one, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def _wait_ready(p: PipelineProc) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(r.get("event") == "ready" for r in p.records()):
            return
        if not p.alive():
            raise TestnetError(f"{p.name} exited at start; see {p.log_path}")
        time.sleep(0.2)
    raise TestnetError(f"{p.name} was not serving after {READY_TIMEOUT_S:.0f} s; see {p.log_path}")


def _driver_row(d: PipelineProc) -> dict:
    recs = d.records()
    losses = [r["loss"] for r in recs if r.get("event") == "microbatch"]
    commits = [r for r in recs if r.get("event") == "commit"]
    vals = [r for r in recs if r.get("event") == "val"]
    done = next((r for r in recs if r.get("event") == "done"), {})
    return {
        "name": d.name,
        "microbatches": len(losses),
        "committed_tokens": sum(c["tokens"] for c in commits),
        "first_loss": sum(losses[:8]) / len(losses[:8]) if losses else None,
        "last_loss": sum(losses[-8:]) / len(losses[-8:]) if losses else None,
        "retries": sum(r.get("retries", 0) for r in recs if r.get("event") == "microbatch"),
        "leases": sum(1 for r in recs if r.get("event") == "lease"),
        "first_at": next((r["at"] for r in recs if r.get("event") == "microbatch"), None),
        "last_at": next((r["at"] for r in reversed(recs) if r.get("event") == "microbatch"), None),
        "val_loss": vals[-1]["val_loss"] if vals else None,
        "val_step": vals[-1]["step"] if vals else None,
        "stopped": done.get("reason", ""),
    }


def _show(view: dict, drivers: list[PipelineProc], elapsed: float) -> None:
    print(f"\n{elapsed:5.0f}s  stage  blocks  peers  samples/s  queue  last move")
    for s in view.get("summary", []):
        blocks = f"{s['first_block']}-{s['end_block'] - 1}" if s["end_block"] > s["first_block"] >= 0 else "-"
        print(f"       {s['stage']:5d}  {blocks:>6}  {s['peers']:5d}  {s['samples_per_s']:9.1f}  {s['queue']:5d}  "
              f"{s['last_move'] or '-'}")
    for d in drivers:
        r = _driver_row(d)
        loss = f"{r['last_loss']:.4f}" if r["last_loss"] is not None else "-"
        val = f", val loss {r['val_loss']:.4f} at run step {r['val_step']}" if r["val_loss"] is not None else ""
        print(f"       {r['name']}: {r['microbatches']} microbatches, {r['committed_tokens']:,} tokens committed, "
              f"loss {loss}{val}")


def _summarize(out: Path, view: dict, drivers: list[PipelineProc], codes: dict, wall: float) -> int:
    rows = [_driver_row(d) for d in drivers]
    print(f"\nsummary after {wall:.0f}s")
    for r in rows:
        first = f"{r['first_loss']:.4f}" if r["first_loss"] is not None else "-"
        last = f"{r['last_loss']:.4f}" if r["last_loss"] is not None else "-"
        val = f", val loss {r['val_loss']:.4f}" if r["val_loss"] is not None else ""
        stopped = f" (stopped: {r['stopped']})" if r["stopped"] else ""
        print(f"{r['name']}: {r['microbatches']} microbatches, {r['committed_tokens']:,} tokens committed over "
              f"{r['leases']} leases, loss {first} -> {last}{val}, {r['retries']} retried{stopped}")
    for s in view.get("summary", []):
        print(f"stage {s['stage']}: {s['peers']} peers, {s['samples_per_s']:.1f} samples/s")
    (out / "summary.json").write_text(
        json.dumps({"wall_s": wall, "exit_codes": codes, "drivers": rows, "stages": view}, indent=1) + "\n"
    )
    # A stage peer or driver stopped by SIGTERM exits 0 (a driver interrupted mid-run: 130).
    bad = {k: v for k, v in codes.items() if v not in (0, 130, None, -signal.SIGTERM)}
    if bad:
        raise TestnetError(f"some processes did not exit cleanly: {bad}; see the logs in {out / 'nodes'}")
    return 0
