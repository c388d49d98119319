"""One stage peer as a process: the tests' multi-process pipelines and a manual check.

    python -m murmur.node.pipeline.peer --identity DIR --run RUN --stage 1 --stages 2 \
        [--layers 2,2] [--preset tiny --dim 64 ...] [--target-samples 16] [--lr 1e-3] \
        [--fault delay:stage_compute:0.2@x*]

It builds its stage of the seed's model, starts the TLS stage service on a free port and prints
one JSON line ``{"event": "ready", "node_id", "address", "stage", ...}``. On SIGTERM or SIGINT
it stops serving and prints ``{"event": "stopped", ...}`` with what it computed (forwards,
backwards, samples, optimizer steps, refusals).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path

import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.net.faults import FaultInjector
from murmur.node.net.server import PeerServer, PeerServerSettings
from murmur.node.pipeline import stage_state
from murmur.node.pipeline.config import add_model_args, model_from_args
from murmur.node.pipeline.membership import Membership
from murmur.node.pipeline.service import StageService, StageServiceSettings
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.identity import Identity
from murmur.protocol.runconfig import OptimSection


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


async def serve(args: argparse.Namespace) -> None:
    cfg, layers = model_from_args(args)
    span = split_layers(cfg.n_layers, args.stages, layers)[args.stage]
    optim = OptimSection(lr=args.lr, warmup_steps=0, grad_clip=args.grad_clip)
    worker = StageWorker(build_stage(cfg, args.seed, span), optim, target_samples=args.target_samples,
                         grad_clip=args.grad_clip)
    settings = StageServiceSettings(host=args.host, max_rows=args.max_rows)
    member = await Membership.join(args.coordinator, args.token) if args.coordinator else None
    ident = member.ident if member is not None else Identity.load(args.identity)
    run_id = member.info.run_id if member is not None else args.run
    service = StageService(ident, worker, run_id=run_id, settings=settings,
                           faults=FaultInjector.parse(args.fault))
    # The peer server publishes this stage's state for peers that join the stage.
    state_server = PeerServer(ident, run_id=run_id, settings=PeerServerSettings(host=args.host))
    state_address = await state_server.start()
    fetched: list[str] = []
    if args.state_from:
        donors = {p["node_id"]: p["state_address"] for p in json.loads(Path(args.state_from).read_text())["peers"]
                  if p["stage"] == span.index and p.get("state_address")}
        fetched = await stage_state.fetch_into(worker.module, ident, donors)
    loop = asyncio.get_running_loop()
    state_server.publish_state(stage_state.published(worker.module))
    worker.on_step = lambda: loop.call_soon_threadsafe(
        state_server.publish_state, stage_state.published(worker.module)
    )
    address = await service.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    emit(event="ready", node_id=service.identity.node_id, address=address, stage=span.index,
         first_block=span.first_block, end_block=span.end_block, state_address=state_address,
         state_hash=stage_state.state_hash(worker.module), fetched_from=fetched)
    await stop.wait()
    await service.stop()
    await state_server.stop()
    if member is not None:
        await member.close()
    st = worker.stats
    emit(event="stopped", node_id=service.identity.node_id, stage=span.index, forwards=st.forwards,
         backwards=st.backwards, samples_total=st.samples_total, optimizer_steps=st.optimizer_steps,
         compute_seconds=st.compute_seconds, refused=len(service.refusals),
         state_hash=stage_state.state_hash(worker.module))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.pipeline.peer")
    ap.add_argument("--identity", help="folder with node.key, node.crt, ca.crt (without --coordinator)")
    ap.add_argument("--coordinator", default="", help="join this coordinator for a certificate")
    ap.add_argument("--token", default="", help="join token (with --coordinator)")
    ap.add_argument("--run", default="murmur-run")
    ap.add_argument("--stage", type=int, required=True)
    add_model_args(ap)
    ap.add_argument("--target-samples", type=int, default=16, help="samples per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="per-stage gradient clipping (0: off)")
    ap.add_argument("--state-from", default="",
                    help="peers JSON file: fetch this stage's state from its peers there before serving")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--fault", action="append", default=[],
                    help="e.g. delay:stage_compute:0.3@x* (a slow peer), see node/net/faults.py")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
