"""One pipeline driver as a process: it holds the data and sends microbatches through the stages.

    python -m murmur.node.pipeline.driver_process --identity DIR --run RUN --peers peers.json \
        --stages 2 [model args] --data DATASET --shard 0 --microbatches 40 \
        [--microbatch-size 4] [--concurrency 2] [--codec bf16] [--commit-log FILE]

Joined to a run whose config has a ``[pipeline]`` section, the run config names the model and the
pipeline, and the stage peers come from the coordinator (``GetStages``, polled every
``--peers-every`` seconds): each peer under the stage it serves now. Otherwise
``peers.json`` is ``{"peers": [{"node_id", "address", "stage"}, ...]}``, re-read every
``--peers-every`` seconds, so whoever launches the stage peers (a test, the testnet) may change
it while the driver runs. Microbatch i holds the tokens [i*B*T, (i+1)*B*T] of the shard (wrapping
round at its end). With ``--coordinator`` and ``--token`` it joins the run instead, leases a
shard and reads microbatches from the lease's committed offset, committing each contiguous range
of completed microbatches to the coordinator's ledger. Output: one JSON line per completed
microbatch (loss, the peer of every hop, retries), one per commit (the contiguous range of
microbatches and their tokens, also appended to ``--commit-log`` and fsynced), and a last line
``{"event": "done", ...}`` with the committed token count and how many hops each peer served.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from murmur.node.model.data import Dataset
from murmur.node.pipeline.client import StageClient, StageEndpoint
from murmur.node.pipeline.config import (
    add_model_args,
    log_to_stderr,
    model_from_args,
    model_from_run,
    refuse_model_args,
)
from murmur.node.pipeline.driver import Driver, MicrobatchFailed, MicrobatchResult, run_in_order
from murmur.node.pipeline.member import PipelineMember
from murmur.node.pipeline.router import Router
from murmur.protocol.coordinator_client import CoordinatorError
from murmur.protocol.identity import Identity
from murmur.protocol.runconfig import PipelineSection, RunConfig, parse_config


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def read_peers(path: Path) -> dict[int, list[StageEndpoint]]:
    data = json.loads(path.read_text())
    out: dict[int, list[StageEndpoint]] = {}
    for p in data["peers"]:
        out.setdefault(int(p["stage"]), []).append(StageEndpoint(p["node_id"], p["address"], int(p["stage"])))
    return out


def microbatch_source(dataset: Dataset, shard: int, rows: int, seq_len: int, base: int = 0, wrap: bool = True):
    """Microbatch i: the B*T tokens from ``base + i*B*T`` of the shard (and the next one as the
    last target), wrapping round at the shard's end when ``wrap``."""
    tokens = dataset.shard(shard)
    span = rows * seq_len
    usable = len(tokens) - 1 - span
    if usable < base:
        raise SystemExit(f"error: shard {shard} holds no microbatch of {span + 1} tokens from {base}")

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = base + i * span
        if wrap:
            o %= usable + 1
        buf = torch.from_numpy(tokens[o : o + span + 1].astype(np.int64))
        return buf[:-1].view(rows, seq_len), buf[1:].view(rows, seq_len)

    return batch


def pipeline_of(args: argparse.Namespace, run: RunConfig | None):
    """(model, pipeline settings): the run config's when it has a [pipeline] section, else the command line's."""
    if run is not None and run.pipeline is not None:
        refuse_model_args(args)
        return model_from_run(run)
    if args.stages is None or not args.peers:
        raise SystemExit("error: --stages and --peers are needed unless the run config has a [pipeline] section")
    model_cfg, layers = model_from_args(args)
    cfg = PipelineSection(
        stages=args.stages, layers=layers, microbatch_size=args.microbatch_size,
        activation_codec=args.codec, hop_timeout_s=args.hop_timeout_s,
        min_hop_timeout_s=args.min_hop_timeout_s, hop_attempts=args.hop_attempts,
        microbatch_attempts=args.microbatch_attempts, microbatch_retry_s=args.microbatch_retry_s,
        bench_s=args.bench_s, max_bench_s=max(60.0, args.bench_s),
    )
    return model_cfg, cfg


async def drive(args: argparse.Namespace) -> int:
    member = lease = run = None
    if args.coordinator:
        member = await PipelineMember.join(args.coordinator, args.token)
        identity = member.ident
        run = parse_config(member.info.config_toml, "the run config")
    else:
        identity = Identity.load(args.identity)
    model_cfg, cfg = pipeline_of(args, run)
    if member is not None:
        lease = await member.acquire()
    client = StageClient(identity, run_id=member.info.run_id if member is not None else args.run)
    router = Router(cfg)
    pipelined = run is not None and run.pipeline is not None

    async def refresh() -> None:
        if pipelined:  # the coordinator's view: each peer under the stage it serves now
            view = await member.stages()
            by_stage: dict[int, list[StageEndpoint]] = {s: [] for s in range(cfg.stages)}
            for p in view.peers:
                if 0 <= p.report.stage < cfg.stages and p.report.address:
                    by_stage[p.report.stage].append(StageEndpoint(p.node_id, p.report.address, p.report.stage))
        else:
            by_stage = read_peers(Path(args.peers))
        for stage, peers in by_stage.items():
            router.set_peers(stage, peers)

    async def keep_refreshing() -> None:
        while True:
            await asyncio.sleep(args.peers_every)
            with contextlib.suppress(OSError, ValueError, KeyError, CoordinatorError):
                await refresh()

    await refresh()
    driver = Driver(client, router, cfg, dim=model_cfg.dim)
    dataset = Dataset.open(args.data)
    tokens_per_mb = cfg.microbatch_size * model_cfg.seq_len
    count = args.microbatches
    if lease is None:
        batches = microbatch_source(dataset, args.shard, cfg.microbatch_size, model_cfg.seq_len)
    else:  # the lease's tokens from its committed offset, no wrapping: the ledger counts them
        batches = microbatch_source(dataset, lease.shard_id, cfg.microbatch_size, model_cfg.seq_len,
                                    base=lease.start_offset, wrap=False)
        count = min(count, (lease.end_offset - lease.start_offset - 1) // tokens_per_mb)
        emit(event="lease", shard=lease.shard_id, start=lease.start_offset, microbatches=count)
    committed_tokens = 0
    losses: dict[int, float] = {}
    log = open(args.commit_log, "a") if args.commit_log else None  # noqa: SIM115 - closed below

    wire_bytes = 0

    def on_done(i: int, res: MicrobatchResult) -> None:
        nonlocal wire_bytes
        losses[i] = res.loss
        wire_bytes += res.wire_bytes
        emit(event="microbatch", index=i, at=time.time(), loss=res.loss, retries=res.retries, wire_bytes=res.wire_bytes,
             hops=[[h.stage, h.kind, h.node_id, h.attempts] for h in res.hops])

    async def on_commit(lo: int, hi: int) -> None:
        nonlocal committed_tokens
        record = {"event": "commit", "start": lo, "end": hi, "tokens": (hi - lo) * tokens_per_mb}
        if lease is not None:
            loss = sum(losses[i] for i in range(lo, hi)) / (hi - lo)
            base = lease.start_offset
            await member.commit(lease, base + lo * tokens_per_mb, base + hi * tokens_per_mb, loss=loss,
                                seconds=0.0)
            record.update(shard=lease.shard_id, ledger_end=base + hi * tokens_per_mb)
        committed_tokens += (hi - lo) * tokens_per_mb
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())
        emit(**record)

    refresher = asyncio.create_task(keep_refreshing())
    status = 0
    end = args.start
    t0 = time.monotonic()
    try:
        end = await run_in_order(driver, batches, count, concurrency=args.concurrency,
                                 on_done=on_done, on_commit=on_commit, start=args.start)
    except MicrobatchFailed as err:
        emit(event="failed", reason=str(err))
        status = 1
    finally:
        refresher.cancel()
        await client.aclose()
        if member is not None:
            await member.close(lease)
        if log is not None:
            log.close()
    served = {st.peer.node_id: st.hops for stage in router.stages.values() for st in stage.values()}
    emit(event="done", committed_tokens=committed_tokens, committed_end=end, hops_by_peer=served,
         seconds=time.monotonic() - t0, wire_bytes=wire_bytes)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.pipeline.driver_process")
    ap.add_argument("--identity", help="folder with node.key, node.crt, ca.crt (without --coordinator)")
    ap.add_argument("--coordinator", default="", help="join this coordinator, lease a shard, commit to its ledger")
    ap.add_argument("--token", default="", help="join token (with --coordinator)")
    ap.add_argument("--run", default="murmur-run")
    ap.add_argument("--peers", default="",
                    help="JSON file naming the stage peers (see the module doc); a pipelined run: the coordinator")
    ap.add_argument("--peers-every", type=float, default=1.0, help="seconds between re-reads of --peers")
    add_model_args(ap)
    ap.add_argument("--data", required=True, help="a prepared dataset folder")
    ap.add_argument("--shard", type=int, default=0, help="without --coordinator: the shard to read")
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--start", type=int, default=0, help="first microbatch index (resume)")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2, help="microbatches in flight")
    ap.add_argument("--codec", default="bf16", help="activation codec: fp32, bf16, int8")
    ap.add_argument("--hop-timeout-s", type=float, default=30.0)
    ap.add_argument("--min-hop-timeout-s", type=float, default=2.0)
    ap.add_argument("--hop-attempts", type=int, default=3)
    ap.add_argument("--microbatch-attempts", type=int, default=3)
    ap.add_argument("--microbatch-retry-s", type=float, default=1.0, help="pause before a re-run, doubling")
    ap.add_argument("--bench-s", type=float, default=2.0)
    ap.add_argument("--commit-log", default="", help="append committed ranges here (JSON lines, fsynced)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log_to_stderr()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl+C does
    try:
        return asyncio.run(drive(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
