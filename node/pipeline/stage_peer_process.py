"""One stage peer as a process: the tests' multi-process pipelines, the testnet and a manual check.

    python -m murmur.node.pipeline.stage_peer_process --coordinator HOST:PORT --token TOKEN [--stage S]
    python -m murmur.node.pipeline.stage_peer_process --identity DIR --run RUN --stage 1 --stages 2 \
        [--layers 2,2] [--preset tiny --dim 64 ...] [--target-samples 16] [--lr 1e-3] \
        [--fault delay:stage_compute:0.2@x*] [--device cuda:0] [--dtype bf16]
    ... [--state-dir DIR]   the peer's identity and its stage's checkpoints; a restart with it
                            is the same node (no token needed) and resumes from them
    ... [--host H] [--port P] [--state-port Q] [--advertise-host A]
                            where its two servers bind (the stage service on P, its peer server
                            on Q, default P + 1; 0: the kernel's choice) and the host others dial

Behind a NAT, forward P and Q from the router and pass its address as ``--advertise-host``: the
coordinator hands out ``A:P`` to drivers and ``A:Q`` to stage-mates (docs/pipeline.md).

With ``--state-dir`` and ``--coordinator`` the peer keeps its key, certificate and join record
there (node/net/member_folder.py, as `murmur node run` does): restarted with the folder it rejoins
as the same node id without a token (only the first join needs one), and the coordinator replaces
its entry in the stage view at its first heartbeat instead of listing the dead one until the
heartbeat TTL. With ``--state-dir`` (in a pipelined run) the peer checkpoints its stage there every
``pipeline.checkpoint_every_s`` and at a clean stop; restarted with the same folder and no
``--stage``, it serves the stage of its newest checkpoint again and loads it (unless a live peer of
the stage gives it newer weights). ``murmur export`` assembles the stage peers' folders into one
model (node/pipeline/stage_checkpoint.py, docs/pipeline.md).

Joined to a run whose config has a ``[pipeline]`` section, the run config names the model and
the pipeline (model arguments on the command line are refused), and without ``--stage`` the
coordinator assigns the stage and may move the peer later (node/pipeline/stage_peer.py).
Otherwise the model comes from the command line and ``--stage`` is required.

``--device`` puts the stage on a GPU (``cuda``, ``cuda:N``; ``auto`` takes one where there is
one); there it computes under bf16 autocast over fp32 weights unless ``--dtype fp32`` (in a
pipelined run, the run's ``train.dtype`` decides). Only the stage's own modules are built, on that
device (node/model/stages.py).

It prints one JSON line ``{"event": "ready", "node_id", "address", "stage", ...}`` once it
serves (with ``stage_param_mb``, ``start_rss_mb``, ``built_peak_rss_mb`` and ``peak_rss_mb``: what
its stage holds, the process's resident memory before the model (the interpreter, torch, grpc and
what an optimizer's first use imports), at its peak once the stage was built, and at its peak so
far), one
``{"event": "stage", ...}`` per move, and on SIGTERM or SIGINT it stops serving and prints
``{"event": "stopped", ...}`` with what it computed (forwards, backwards, samples, optimizer
steps, refusals) and its peak resident memory (on a GPU also ``gpu_peak_mb`` and
``gpu_reserved_peak_mb``: its tensors' peak on the device and torch's allocator's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from murmur.node.net.faults import FaultInjector
from murmur.node.net.member_folder import MemberFolder
from murmur.node.pipeline import stage_checkpoint, stage_state
from murmur.node.pipeline.config import (
    MIB,
    PipelineSection,
    add_device_args,
    add_model_args,
    autocast_of,
    log_to_stderr,
    message_limits,
    model_from_args,
    model_from_run,
    refuse_model_args,
)
from murmur.node.pipeline.member import PipelineMember
from murmur.node.pipeline.memory import (
    freeze_startup_heap,
    peak_rss_mb,
    return_freed_memory,
    rss_mb,
    thaw_startup_heap,
)
from murmur.node.pipeline.schedule import RunSchedule
from murmur.node.pipeline.stage_peer import StagePeer, StagePeerSettings
from murmur.node.train.build import resolve_device
from murmur.protocol.coordinator_client import CoordinatorError
from murmur.protocol.identity import Identity
from murmur.protocol.runconfig import OptimSection, parse_config


def print_record(record: dict) -> None:
    print(json.dumps(record), flush=True)


SINK = print_record  # where records go: stdout's JSON lines; `murmur node run` logs them its way


def emit(**record: object) -> None:
    SINK(record)


def gpu_memory(device: str) -> dict:
    """On a GPU stage: the peak of what its tensors took on the device, and of what torch's
    allocator reserved there (what other processes on the card cannot use), in MiB."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    return {"gpu_peak_mb": round(torch.cuda.max_memory_allocated(dev) / MIB, 1),
            "gpu_reserved_peak_mb": round(torch.cuda.max_memory_reserved(dev) / MIB, 1)}


def settings_of(args: argparse.Namespace, member: PipelineMember | None):
    """(model, StagePeerSettings, the run's schedule) from the run config when it is pipelined, else
    from the command line (a constant lr, no schedule)."""
    run = parse_config(member.info.config_toml, "the run config") if member is not None else None
    device = resolve_device(args.device)
    if run is not None and run.pipeline is not None:
        refuse_model_args(args)
        model, pipe = model_from_run(run)
        cap, payload = message_limits(pipe)
        schedule = RunSchedule.of(run, model.seq_len)
        return model, StagePeerSettings(
            stages=pipe.stages, layers=pipe.layers, seed=run.seed, optim=run.optim,
            target_samples=pipe.target_samples, grad_clip=run.optim.grad_clip, replica_every_s=pipe.replica_every_s,
            host=args.host, port=args.port, state_port=args.state_port, advertise_host=args.advertise_host,
            max_rows=args.max_rows, pipelined=True, sync=run.sync, sync_every_s=pipe.sync_every_s,
            sync_every_samples=pipe.sync_every_samples,
            stop_sync_s=pipe.stop_sync_s, sync_bucket_mb=pipe.sync_bucket_mb,
            device=str(device), autocast=autocast_of(run.train.dtype, device), max_message_bytes=cap,
            max_payload_bytes=payload, step_expire_s=pipe.hop_timeout_s, lr_now=schedule.lr, heard=schedule.heard,
            state_dir=Path(args.state_dir) if args.state_dir else None, checkpoint_every_s=pipe.checkpoint_every_s,
            checkpoint_keep=pipe.checkpoint_keep,
            tokens_committed=lambda: schedule.tokens_committed, step_at=schedule.step_at, run_config=run.to_dict(),
        ), schedule
    if args.state_dir:
        raise SystemExit("error: --state-dir needs a pipelined run (--coordinator, a run config with [pipeline])")
    if args.stages is None or args.stage is None:
        raise SystemExit("error: --stage and --stages are needed unless the run config has a [pipeline] section")
    model, layers = model_from_args(args)
    cap, payload = message_limits(PipelineSection(message_cap_mb=args.message_cap_mb,
                                                  max_payload_mb=max(args.max_payload_mb, args.message_cap_mb)))
    return model, StagePeerSettings(
        stages=args.stages, layers=layers, seed=args.seed,
        optim=OptimSection(lr=args.lr, warmup_steps=0, grad_clip=args.grad_clip),
        target_samples=args.target_samples, grad_clip=args.grad_clip, host=args.host, port=args.port,
        state_port=args.state_port, advertise_host=args.advertise_host, max_rows=args.max_rows,
        device=str(device), autocast=autocast_of(args.dtype, device), max_message_bytes=cap,
        max_payload_bytes=payload,
    ), None


async def show_progress(peer: StagePeer, every_s: float) -> None:
    """A line on stderr now and then: the stage it serves and how it goes."""
    log = logging.getLogger("murmur.node.pipeline.stage_peer_process")
    while every_s > 0:
        await asyncio.sleep(every_s)
        rep = peer.report()
        sync = f", {peer.sync.rounds} sync rounds ({peer.sync.failed} failed)" if peer.sync else ""
        lr = peer.worker.optimizer.param_groups[0]["lr"] if peer.worker is not None else 0.0
        log.info("stage %d of %d (blocks %d-%d): %d samples, %d steps at lr %.2e, %.1f samples/s, queue %d%s",
                 rep.stage, peer.settings.stages, rep.first_block, rep.end_block - 1, rep.samples_total,
                 rep.optimizer_steps, lr, rep.samples_per_s, rep.queue, sync)


PROGRESS_EVERY_S = 0.5  # at most: the lr of a step lags the run's progress by about this


async def follow_progress(member: PipelineMember, schedule: RunSchedule, every_s: float) -> None:
    """The run's ledger total, polled: the lr of every step follows it."""
    while True:
        with contextlib.suppress(CoordinatorError):
            schedule.heard((await member.stages()).tokens_committed)
        await asyncio.sleep(every_s)


async def serve(args: argparse.Namespace, joined: Callable[[], PipelineMember] | None = None) -> None:
    """Serve until SIGTERM or SIGINT. ``joined``: the membership of a node that already joined
    (`murmur node run`, node/daemon/pipeline_role.py, which says Leave after) instead of joining
    with ``args.token``."""
    # The optimizer's first use imports torch._dynamo (~140 MiB here), a fixed cost of any process
    # that trains (murmur train's too), not of the stage: paid before the base is read, so that the
    # base is the bare process and what the stage costs is measured above it.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    start_rss = rss_mb()  # the interpreter, torch, grpc and the optimizer's imports, before any of the model
    if joined is not None:
        member = joined()
    else:
        if args.state_dir:  # its checkpoints' checksums, before the join (one line if one is corrupt)
            stage_checkpoint.verify_folder(Path(args.state_dir))
        folder = MemberFolder(args.state_dir) if args.state_dir and args.coordinator else None
        member = await PipelineMember.join(args.coordinator, args.token, folder) if args.coordinator else None
    model, settings, schedule = settings_of(args, member)
    follower = None
    if schedule is not None:
        every = min(PROGRESS_EVERY_S, member.info.heartbeat_interval_s)
        follower = asyncio.create_task(follow_progress(member, schedule, every))
    ident = member.ident if member is not None else Identity.load(args.identity)
    run_id = member.info.run_id if member is not None else args.run
    donors = None
    if args.state_from:
        donors = {p["node_id"]: p["state_address"] for p in json.loads(Path(args.state_from).read_text())["peers"]
                  if p["stage"] == args.stage and p.get("state_address")}
    elif member is None:
        donors = {}
    peer = StagePeer(ident, run_id, model, settings, member=member, faults=FaultInjector.parse(args.fault),
                     on_event=emit)
    await peer.start(args.stage, donors)
    await peer.wait_serving()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    span = peer.service.span
    freeze_startup_heap()
    emit(event="ready", node_id=ident.node_id, address=peer.address, stage=span.index,
         first_block=span.first_block, end_block=span.end_block, state_address=peer.state_address,
         state_hash=stage_state.state_hash(peer.worker.module), fetched_from=peer.fetched_from,
         state_source=peer.state_source, device=peer.settings.device, autocast=peer.settings.autocast,
         stage_param_mb=round(peer.worker.module.parameter_bytes() / MIB, 3),
         start_rss_mb=round(start_rss, 1), built_peak_rss_mb=round(peer.built_peak_rss_mb, 1),
         peak_rss_mb=round(peak_rss_mb(), 1),
         checkpoint_version=peer.loaded_checkpoint.version if peer.loaded_checkpoint is not None else None,
         **gpu_memory(peer.settings.device),
         process_cpu_seconds=round(time.process_time(), 3))  # every thread's, since the start (with "stopped")
    progress = asyncio.create_task(show_progress(peer, args.progress_every))
    await stop.wait()
    progress.cancel()
    if follower is not None:
        follower.cancel()
    worker, service = peer.worker, peer.service
    await peer.stop()
    thaw_startup_heap()
    if member is not None:
        await member.close()
    st = worker.stats
    emit(event="stopped", node_id=ident.node_id, stage=service.span.index, forwards=st.forwards,
         backwards=st.backwards, samples_total=st.samples_total, optimizer_steps=st.optimizer_steps,
         compute_seconds=st.compute_seconds, cpu_seconds=st.cpu_seconds, refused=len(service.refusals),
         moves=peer.moves,
         sync_rounds=peer.sync.rounds if peer.sync else 0, sync_failed=peer.sync.failed if peer.sync else 0,
         sync_last_round=peer.sync.last_round if peer.sync else -1,
         sync_adopted=peer.sync.adopted if peer.sync else 0,
         sync_last_error=peer.sync.last_error if peer.sync else "",
         sync_idle_rounds=peer.sync.idle_rounds if peer.sync else 0,
         # the last round at the stop with the mates that stopped too (node/pipeline/stop_sync.py):
         # its members (0: none run), whether it completed, how long the stop spent on it
         final_sync_members=peer.final_sync.members, final_sync_completed=peer.final_sync.completed,
         final_sync_seconds=peer.final_sync.seconds, final_sync_error=peer.final_sync.error,
         sync_round_peak_mb=round(peer.sync.peak_round_bytes / MIB, 1) if peer.sync else 0.0,
         sync_parts=peer.sync.parts if peer.sync else 0,
         checkpoints_written=peer.checkpoints_written,
         # forwards held at the step boundary for the next optimizer step, and those forgotten there
         # because their backward never came (node/pipeline/step_gate.py)
         step_holds=service.gate.held, step_expired=service.gate.expired,
         checkpoint_version=peer.last_checkpoint.version if peer.last_checkpoint is not None else None,
         lr=worker.optimizer.param_groups[0]["lr"], run_step=schedule.step if schedule is not None else None,
         sync_holds_state=peer.sync.holds_state if peer.sync else False,
         state_copies=peer.publisher.copies if peer.publisher else 0,
         state_copied_mb_max=round(peer.publisher.copied_bytes_max / MIB, 1) if peer.publisher else 0.0,
         state_hash=stage_state.state_hash(worker.module), peak_rss_mb=round(peak_rss_mb(), 1),
         stage_param_mb=round(worker.module.parameter_bytes() / MIB, 3), **gpu_memory(peer.settings.device),
         process_cpu_seconds=round(time.process_time(), 3))


def main(argv: list[str] | None = None, joined: Callable[[], PipelineMember] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.pipeline.stage_peer_process")
    ap.add_argument("--identity", help="folder with node.key, node.crt, ca.crt (without --coordinator)")
    ap.add_argument("--coordinator", default="", help="join this coordinator for a certificate")
    ap.add_argument("--token", default="",
                    help="join token (with --coordinator; not needed to rejoin with a --state-dir that joined before)")
    ap.add_argument("--run", default="murmur-run")
    ap.add_argument("--stage", type=int, default=None,
                    help="the stage to serve (default in a pipelined run: the coordinator assigns it)")
    add_model_args(ap)
    add_device_args(ap)
    ap.add_argument("--message-cap-mb", type=float, default=PipelineSection().message_cap_mb,
                    help="one gRPC message; bigger payloads stream (joined to a pipelined run: the run's setting)")
    ap.add_argument("--max-payload-mb", type=float, default=PipelineSection().max_payload_mb,
                    help="the most one streamed payload may carry")
    ap.add_argument("--target-samples", type=int, default=16, help="samples per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="per-stage gradient clipping (0: off)")
    ap.add_argument("--state-from", default="",
                    help="peers JSON file: fetch this stage's state from its peers there before serving")
    ap.add_argument("--state-dir", default="",
                    help="keep the identity and the stage's checkpoints in this folder; restarted with it, "
                         "rejoin as the same node and resume from them")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--host", default="127.0.0.1", help="where the stage service and the peer server bind")
    ap.add_argument("--port", type=int, default=0,
                    help="the stage service's port, fixed to forward through a NAT (0: the kernel's choice)")
    ap.add_argument("--state-port", type=int, default=None,
                    help="the peer server's port (stage-mates sync, joiners fetch the stage); default: --port + 1 "
                         "when --port is set, else the kernel's choice")
    ap.add_argument("--advertise-host", default="",
                    help="the host drivers and stage-mates should dial (behind a NAT: the router's public "
                         "address, whose --port and --state-port forward here); default: --host")
    ap.add_argument("--fault", action="append", default=[],
                    help="e.g. delay:stage_compute:0.3@x* (a slow peer), see node/net/faults.py")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines (0: none)")
    args = ap.parse_args(argv)
    if args.state_port is None:
        args.state_port = args.port + 1 if args.port else 0
    for flag, port in (("--port", args.port), ("--state-port", args.state_port)):
        if not 0 <= port <= 65535:
            ap.error(f"{flag} {port} is not a port (0-65535)")
    if args.port and args.port == args.state_port:
        ap.error(f"--port and --state-port are both {args.port}: the two servers need a port each")
    torch.set_num_threads(args.threads)
    return_freed_memory()  # before the stage is built: copies of it freed leave the process (memory.py)
    log_to_stderr()
    try:
        asyncio.run(serve(args, joined))
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - one line, not a traceback, for a volunteer
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
