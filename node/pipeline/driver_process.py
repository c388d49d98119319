"""One pipeline driver as a process: it holds the data and sends microbatches through the stages.

    python -m murmur.node.pipeline.driver_process --coordinator HOST:PORT --token TOKEN --data DATASET \
        [--state-dir DIR]
    python -m murmur.node.pipeline.driver_process --identity DIR --run RUN --peers peers.json \
        --stages 2 [model args] --data DATASET --shard 0 --microbatches 40 \
        [--microbatch-size 4] [--concurrency 4] [--codec bf16] [--commit-log FILE]

With ``--state-dir`` the driver keeps its key, certificate and join record in that folder
(node/net/member_folder.py, as `murmur node run` does): restarted with it, it rejoins as the same
node id without a token, and since a lease belongs to a node id, its first ask gets back the lease
it held, from the ledger's committed offset, at once (not after the lease TTL); what the killed
process had sent but not committed is sent again and counted once.

Joined to a run (``--coordinator`` and ``--token``) whose config has a ``[pipeline]`` section, the
run config names the model and the pipeline, the stage peers come from the coordinator
(``GetStages``, polled every ``--peers-every`` seconds: each peer under the stage it serves now),
and the driver follows the run's schedule (node/pipeline/schedule.py, docs/pipeline.md "Drivers
and the run's schedule"): it leases shard after shard, sends each lease's tokens from its
committed offset, commits each contiguous range of completed microbatches to the ledger (with the
validation loss when the commit crosses an evaluation point) and stops at the schedule's end, when
every shard is done, or after ``--microbatches`` if given. Otherwise ``peers.json`` is ``{"peers":
[{"node_id", "address", "stage"}, ...]}``, re-read every ``--peers-every`` seconds, so whoever
launches the stage peers (a test, the testnet) may change it while the driver runs, and
microbatch i holds the tokens [i*B*T, (i+1)*B*T] of ``--shard`` (wrapping round at its end).

Output: with ``--coordinator``, first ``{"event": "joined", "node_id", "run_id", "rejoined"}``
(``rejoined``: with the record of its state folder, no token spent); one JSON line per lease,
per completed microbatch (loss, the peer of every hop, retries), per evaluation (``val``) and per
commit (the contiguous range of microbatches and their tokens, also appended to ``--commit-log``
and fsynced), and a last line ``{"event": "done", ...}`` with why it stopped, what it committed
(tokens, microbatches, the end index) and how many hops each peer served.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from murmur.errors import MurmurError
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.net.member_folder import MemberFolder
from murmur.node.pipeline.client import StageClient, StageEndpoint
from murmur.node.pipeline.config import (
    add_model_args,
    log_to_stderr,
    message_limits,
    model_from_args,
    model_from_run,
    refuse_model_args,
)
from murmur.node.pipeline.driver import (
    DEFAULT_CONCURRENCY,
    Driver,
    MicrobatchFailed,
    MicrobatchResult,
    run_in_order,
)
from murmur.node.pipeline.member import REFUSALS, PipelineMember
from murmur.node.pipeline.memory import freeze_startup_heap
from murmur.node.pipeline.router import Router
from murmur.node.pipeline.schedule import RunSchedule
from murmur.node.train.build import resolve_device
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.coordinator_client import CoordinatorError
from murmur.protocol.identity import Identity
from murmur.protocol.lease_status import LeaseAction
from murmur.protocol.lease_status import action as lease_action
from murmur.protocol.runconfig import PipelineSection, RunConfig, parse_config

UNLIMITED = 1 << 62  # --microbatches left out: the run's schedule decides
LEASE_WAIT_S = 2.0  # between asks while every unfinished shard is leased to another driver
progress_log = logging.getLogger("murmur.node.pipeline.driver")


def print_record(record: dict) -> None:
    print(json.dumps(record), flush=True)


SINK = print_record  # where records go: stdout's JSON lines; `murmur node run` logs them its way
STOPPED_BY = ""  # the signal that stopped the driving ("" if none): `murmur node run` names it


def emit(**record: object) -> None:
    SINK(record)


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
        bench_s=args.bench_s, max_bench_s=max(60.0, args.bench_s), stage_wait_s=args.stage_wait_s,
    )
    return model_cfg, cfg


def lease_plan(start: int, end: int, rows: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The microbatches of a lease's tokens [start, end): (offset, rows, commit end) of each. Each
    holds ``rows`` sequences (the last one of the shard fewer, if that is what is left) and their
    next-token targets; the shard's tail that holds no whole sequence (< seq_len + 1 tokens) is
    committed with the last microbatch, so the shard is done when its microbatches are."""
    plan: list[list[int]] = []
    o = start
    while (left := (end - o - 1) // seq_len) >= 1:
        r = min(rows, left)
        plan.append([o, r, o + r * seq_len])
        o += r * seq_len
    if plan:
        plan[-1][2] = end
    return [(a, b, c) for a, b, c in plan]


def measured_rates(router: Router) -> list[pb.MeasuredRate]:
    """The router's measurement of every stage peer it sent hops to, for the coordinator."""
    return [pb.MeasuredRate(node_id=st.peer.node_id, stage=stage, samples_per_s=st.throughput(0.0))
            for stage, peers in router.stages.items() for st in peers.values() if st.ema_n]


class LeaseGone(Exception):
    """The coordinator refused a commit (the lease expired or was taken): lease again."""


async def next_lease(member: PipelineMember, schedule: RunSchedule, exhausted: list[str]) -> pb.Lease | None:
    """A lease (waiting while every unfinished shard is leased), or None when there is nothing left
    to train: every shard done, the run finished, or the schedule's end reached meanwhile."""
    while not schedule.done:
        reply = await member.client.acquire(exhausted)
        if reply.granted:
            return reply.lease
        if lease_action(reply) is LeaseAction.STOP:  # the typed status, never the words
            emit(event="no_lease", reason=reply.reason)
            return None
        await asyncio.sleep(LEASE_WAIT_S)
    return None


async def drive(args: argparse.Namespace, joined: Callable[[], PipelineMember] | None = None) -> int:
    """Drive until the schedule ends; ``joined``: the membership of a node that already joined
    (`murmur node run`, node/daemon/pipeline_role.py) instead of joining with ``args.token``.
    Either way the member is closed here (its heartbeats renew the lease, which ends with the driving)."""
    # SIGTERM cancels the driving, as Ctrl+C does (asyncio.run's own SIGINT handling): a
    # KeyboardInterrupt raised by a Python-level handler lands wherever the loop happens to be,
    # and inside grpc's callbacks it is swallowed ("Exception ignored in ... functor_run"), the
    # call it belonged to never completes, and the driver hangs on instead of stopping.
    task = asyncio.current_task()

    def sigterm() -> None:
        global STOPPED_BY
        STOPPED_BY = "SIGTERM"
        task.cancel()

    with contextlib.suppress(NotImplementedError, RuntimeError):  # no signals off the main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, sigterm)
    device = args.device
    member = run = None
    if joined is not None or args.coordinator:
        folder = MemberFolder(args.state_dir) if args.state_dir else None
        member = joined() if joined is not None else await PipelineMember.join(args.coordinator, args.token, folder)
        identity = member.ident
        emit(event="joined", node_id=member.info.node_id, run_id=member.info.run_id, rejoined=member.rejoined)
        run = parse_config(member.info.config_toml, "the run config")
    else:
        identity = Identity.load(args.identity)
    model_cfg, cfg = pipeline_of(args, run)
    cap, payload = message_limits(cfg)  # the same limits the stage peers were given
    client = StageClient(identity, run_id=member.info.run_id if member is not None else args.run,
                         max_message_bytes=cap, max_payload_bytes=payload)
    router = Router(cfg)
    pipelined = run is not None and run.pipeline is not None
    schedule = RunSchedule.of(run, model_cfg.seq_len) if member is not None else None

    async def refresh() -> None:
        if pipelined:  # the coordinator's view: each peer under the stage it serves now
            view = await member.stages()
            schedule.heard(view.tokens_committed)
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
    if member is not None:
        member.measured = lambda: measured_rates(router)
    driver = Driver(client, router, cfg, dim=model_cfg.dim,
                    progress=(lambda: schedule.tokens_committed) if schedule is not None else None)
    dataset = Dataset.open(args.data)
    tokens_per_mb = cfg.microbatch_size * model_cfg.seq_len
    losses: dict[int, float] = {}
    log = open(args.commit_log, "a") if args.commit_log else None  # noqa: SIM115 - closed below
    tally = {"tokens": 0, "microbatches": 0, "end": args.start, "wire_bytes": 0}
    val_losses: list[dict] = []
    val_set = []
    if run is not None:
        per_batch = max(1, run.train.batch_size // cfg.microbatch_size)  # as many sequences as a node's eval
        val_set = eval_batches(dataset, cfg.microbatch_size, model_cfg.seq_len, run.train.eval_batches * per_batch)

    def on_done(i: int, res: MicrobatchResult) -> None:
        losses[i] = res.loss
        tally["wire_bytes"] += res.wire_bytes
        emit(event="microbatch", index=i, at=time.time(), loss=res.loss, retries=res.retries, wire_bytes=res.wire_bytes,
             hops=[[h.stage, h.kind, h.node_id, h.attempts] for h in res.hops])

    async def evaluate(step: int) -> float | None:
        """The validation loss through the stages now, or None if a stage did not answer."""
        if not val_set:
            return None
        t0 = time.monotonic()
        try:
            vals = [await driver.evaluate(f"val{step}.{k}", x, y) for k, (x, y) in enumerate(val_set)]
        except MicrobatchFailed as err:  # the next evaluation point tries again
            emit(event="val_skipped", step=step, reason=str(err))
            return None
        val = sum(vals) / len(vals)
        val_losses.append({"step": step, "val_loss": val})
        emit(event="val", step=step, val_loss=val, batches=len(vals), seconds=round(time.monotonic() - t0, 3))
        progress_log.info("run step %d of %d: val loss %.4f", step, schedule.steps, val)
        return val

    def write_log(record: dict) -> None:
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())

    def committed(lo: int, hi: int, tokens: int, record: dict) -> None:
        tally["tokens"] += tokens
        tally["microbatches"] += hi - lo
        tally["end"] = hi
        write_log(record)
        emit(**record)

    refresher = asyncio.create_task(keep_refreshing())
    status, why = 0, ""
    freeze_startup_heap()  # the imports, the data and the channels: out of the collector's walks
    t0, cpu0 = time.monotonic(), time.process_time()
    try:
        if member is None:  # a fixed range of one shard, wrapping round (the tests, a manual check)
            batches = microbatch_source(dataset, args.shard, cfg.microbatch_size, model_cfg.seq_len)

            def on_commit(lo: int, hi: int) -> None:
                committed(lo, hi, (hi - lo) * tokens_per_mb,
                          {"event": "commit", "start": lo, "end": hi, "tokens": (hi - lo) * tokens_per_mb})

            await run_in_order(driver, batches, args.microbatches, concurrency=args.concurrency,
                               on_done=on_done, on_commit=on_commit, start=args.start)
            why = f"--microbatches {args.microbatches} done"
        else:
            why = await follow_schedule(args, member, schedule, driver, dataset, cfg, model_cfg, on_done,
                                        committed, losses, evaluate, tally)
    except (MicrobatchFailed, CoordinatorError) as err:  # a stage never refilled, a coordinator gone for good
        emit(event="failed", reason=str(err))
        status, why = 1, f"failed: {err}"
    finally:
        refresher.cancel()
        await client.aclose()
        if member is not None:
            await member.close(None)
        if log is not None:
            log.close()
    served = {st.peer.node_id: st.hops for stage in router.stages.values() for st in stage.values()}
    emit(event="done", reason=why, device=str(device), committed_tokens=tally["tokens"],
         committed_microbatches=tally["microbatches"], committed_end=tally["end"], hops_by_peer=served,
         seconds=time.monotonic() - t0, cpu_seconds=round(time.process_time() - cpu0, 3),  # every thread's
         wire_bytes=tally["wire_bytes"], val=val_losses[-1] if val_losses else None,
         run_step=schedule.step if schedule is not None else None)
    return status


async def follow_schedule(args, member, schedule, driver, dataset, cfg, model_cfg, on_done, committed, losses,
                          evaluate, tally) -> str:
    """Lease shard after shard and send their microbatches through, committing each contiguous range
    as it completes, until the run's schedule ends, every shard is done or ``--microbatches`` have
    been sent. A lease whose commit is refused (lost while the driver waited for a stage) is given
    up and the next lease resumes from the ledger's offset. Returns why it stopped."""
    seq_len, rows = model_cfg.seq_len, cfg.microbatch_size
    next_index = args.start
    exhausted: list[str] = []
    while True:
        left = args.microbatches - (next_index - args.start)
        if left <= 0:
            return f"--microbatches {args.microbatches} done"
        if schedule.done:
            return "schedule done"
        lease = await next_lease(member, schedule, exhausted)
        if lease is None:
            return "schedule done" if schedule.done else "nothing left to lease"
        plan = lease_plan(lease.start_offset, lease.end_offset, rows, seq_len)
        if not plan:  # a tail too short for one sequence: held as exhausted, another shard granted
            exhausted.append(lease.lease_id)
            continue
        budget = -(-(schedule.budget_tokens - schedule.tokens_committed) // (rows * seq_len))
        count = max(1, min(len(plan), left, budget))
        first = next_index
        tokens = dataset.shard(lease.shard_id)
        emit(event="lease", shard=lease.shard_id, start=lease.start_offset, microbatches=count, first=first)

        def batches(i: int, plan=plan, first=first, tokens=tokens):
            o, r, _ = plan[i - first]
            buf = torch.from_numpy(tokens[o : o + r * seq_len + 1].astype(np.int64))
            return buf[:-1].view(r, seq_len), buf[1:].view(r, seq_len)

        async def on_commit(lo: int, hi: int, lease=lease, plan=plan, first=first) -> None:
            # A range that takes the run past an evaluation point is committed in two: up to the
            # microbatch that crosses it (with the validation loss), then the rest. So the figures
            # land at the evaluation points (run steps 10, 20, ...) however many microbatches one
            # commit holds: with several in flight, completions out of order make ranges longer.
            while lo < hi:
                before, start = schedule.tokens_committed, plan[lo - first][0]
                cut = next((j + 1 for j in range(lo, hi)
                            if schedule.evaluation_due(before, before + plan[j - first][2] - start)), hi)
                await commit_range(lo, cut, lease, plan, first)
                lo = cut

        async def commit_range(lo: int, hi: int, lease, plan, first) -> None:
            start, end = plan[lo - first][0], plan[hi - 1 - first][2]
            loss = sum(losses.pop(i) for i in range(lo, hi)) / (hi - lo)  # popped: a long run's memory stays flat
            before = schedule.tokens_committed
            step = schedule.step_at(before + end - start)
            val = None
            # The commit that takes the run past an evaluation point (by this driver's newest view of
            # the ledger) carries the validation loss of the weights that trained its microbatches.
            if schedule.evaluation_due(before, before + end - start):
                val = await evaluate(step)

            async def commit_and_record() -> None:
                try:
                    reply = await member.commit(lease, start, end, loss=loss, seconds=0.0, step=step, val_loss=val)
                except CoordinatorError as err:
                    if err.code in REFUSALS:
                        raise LeaseGone(str(err)) from None
                    raise
                schedule.heard(reply.run_tokens_committed)
                committed(lo, hi, end - start, {"event": "commit", "start": lo, "end": hi, "tokens": end - start,
                                                "shard": lease.shard_id, "ledger_end": end, "run_step": step,
                                                "run_tokens": reply.run_tokens_committed, "val_loss": val})

            # A SIGTERM (which cancels the driving) during a commit waits for its answer and records
            # it: cut off, the coordinator had the range and the commit log did not (a loaded CI
            # run's ledger held 3 microbatches more than the log of the driver it stopped).
            recording = asyncio.ensure_future(commit_and_record())
            try:
                await asyncio.shield(recording)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await recording
                raise

        try:
            # Other drivers' commits count too: stop starting microbatches once the run's schedule
            # is done by the newest view of the ledger (within a microbatch or two a driver).
            end = await run_in_order(driver, batches, count, concurrency=args.concurrency, on_done=on_done,
                                     on_commit=on_commit, start=first, stop=lambda: schedule.done)
        except LeaseGone as err:
            emit(event="lease_lost", shard=lease.shard_id, reason=str(err))
            next_index = tally["end"]  # the lost lease's uncommitted microbatches are another lease's now
            continue
        next_index = end
        if end - first < len(plan):  # cut short by the schedule or --microbatches: the rest is another's
            with contextlib.suppress(CoordinatorError):
                await member.client.release(lease.lease_id)


def main(argv: list[str] | None = None, joined: Callable[[], PipelineMember] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.pipeline.driver_process")
    ap.add_argument("--identity", help="folder with node.key, node.crt, ca.crt (without --coordinator)")
    ap.add_argument("--coordinator", default="", help="join this coordinator, lease a shard, commit to its ledger")
    ap.add_argument("--token", default="",
                    help="join token (with --coordinator; not needed to rejoin with a --state-dir that joined before)")
    ap.add_argument("--state-dir", default="",
                    help="with --coordinator: keep the identity and join record here; restarted with it, the driver "
                         "rejoins as the same node (no token) and resumes its lease from the ledger at once")
    ap.add_argument("--run", default="murmur-run")
    ap.add_argument("--peers", default="",
                    help="JSON file naming the stage peers (see the module doc); a pipelined run: the coordinator")
    ap.add_argument("--peers-every", type=float, default=1.0, help="seconds between re-reads of --peers")
    add_model_args(ap)
    ap.add_argument("--data", required=True, help="a prepared dataset folder")
    ap.add_argument("--shard", type=int, default=0, help="without --coordinator: the shard to read")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="at most this many (required without --coordinator; with it the run's schedule decides)")
    ap.add_argument("--start", type=int, default=0, help="first microbatch index (resume)")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                    help=f"microbatches in flight (default {DEFAULT_CONCURRENCY}: docs/pipeline.md)")
    ap.add_argument("--codec", default="bf16", help="activation codec: fp32, bf16, int8")
    ap.add_argument("--hop-timeout-s", type=float, default=30.0)
    ap.add_argument("--min-hop-timeout-s", type=float, default=2.0)
    ap.add_argument("--hop-attempts", type=int, default=3)
    ap.add_argument("--microbatch-attempts", type=int, default=3)
    ap.add_argument("--microbatch-retry-s", type=float, default=1.0, help="pause before a re-run, doubling")
    ap.add_argument("--bench-s", type=float, default=2.0)
    ap.add_argument("--stage-wait-s", type=float, default=PipelineSection().stage_wait_s,
                    help="how long to wait for a stage no peer answers before stopping (without a [pipeline] config)")
    ap.add_argument("--device", default="cpu",
                    help="cpu, cuda or cuda:N, checked at start and reported; a driver runs no layer of the model "
                         "(the stage peers do), so cpu is the usual choice")
    ap.add_argument("--commit-log", default="", help="append committed ranges here (JSON lines, fsynced)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.microbatches is None:
        if not args.coordinator:
            ap.error("--microbatches is required without --coordinator")
        args.microbatches = UNLIMITED
    if args.microbatches < 1:
        ap.error(f"--microbatches must be at least 1, got {args.microbatches}")
    if args.state_dir and not args.coordinator:
        ap.error("--state-dir keeps a membership of a run: it needs --coordinator")
    torch.set_num_threads(args.threads)
    log_to_stderr()
    try:
        args.device = resolve_device(args.device)
    except MurmurError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Until the loop runs (and after it), SIGTERM stops the driver as Ctrl+C does.
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(drive(args, joined))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except MurmurError as err:  # a refused join, a folder another driver holds: one line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        # asyncio leaves SIGTERM at its default (the process dies) once the loop closes; the
        # volunteer that called this still has to leave the run.
        signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    raise SystemExit(main())
