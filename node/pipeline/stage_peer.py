"""A stage peer: one stage of the model served over gRPC, moved between stages by the coordinator.

The peer owns a stage service (node/pipeline/service.py) and a peer server on which it publishes
its stage's parameters (node/pipeline/stage_state.py). In a pipelined run it heartbeats a
`StageReport` and obeys the coordinator's `StageOrder`s (coordinator/stage_board.py):

- **Becoming a stage** (at start, or ordered to move): the peer builds the stage from the seed
  and loads its state, in this order of preference: from the peers serving it now (hash-verified,
  in parallel); else from its own checkpoint unless the coordinator's kept set is newer; else from
  a replica (its own, or one a peer of the previous stage publishes); else from the coordinator's
  kept set (node/pipeline/kept_stage.py, ``state_source = "kept"``); else it keeps the seed's
  weights and says so (``state_source = "seed"``, a warning in the log), which under a run that
  trained needs the operator's word (the run waits for it, as a data-parallel run does).
  A peer that moves keeps serving its old stage while it loads; then the service switches to the
  new stage between two calls, and the next heartbeat goes out at once.
- **Checkpoints** (with a state folder, ``state_dir``): at every multiple of
  ``checkpoint_every_s`` of the clock, and at a clean stop, the peer writes its stage (weights,
  AdamW, the sync's outer state) to its folder (node/pipeline/stage_checkpoint.py) and reports it
  to the coordinator, which records the newest complete set. A peer restarted with its folder and
  no ``--stage`` claims the stage of its newest checkpoint; becoming a stage, it loads that
  stage's checkpoint (weights and AdamW) when no live peer of the stage gives it the weights.
- **Addresses**: both servers bind ``host``, on ``port`` and ``state_port`` (0: the kernel's
  choice; fixed ones are what a volunteer behind a NAT forwards), and the peer reports them under
  ``advertise_host`` (node/net/addresses.py's rule), which is what drivers and stage-mates dial.
- **Replicas**: every ``replica_every_s`` a peer of stage s copies the weights of stage s+1 (the
  last stage: of stage 0) from that stage's peers, when they changed, and publishes the copy. A
  stage whose every peer dies is then refilled with weights at most that old, not the seed's.

One stage peer as a process (its command line, its JSON lines): node/pipeline/stage_peer_process.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import ModelConfig
from murmur.node.net.addresses import advertised_address
from murmur.node.net.faults import FaultInjector
from murmur.node.net.server import PeerServer, PeerServerSettings, PublishedState
from murmur.node.net.state_transfer import StateError, afetch
from murmur.node.pipeline import kept_stage, replica, stage_checkpoint, stage_state, stop_sync
from murmur.node.pipeline.member import PipelineMember
from murmur.node.pipeline.memory import collect_cycles, peak_rss_mb
from murmur.node.pipeline.service import StageService, StageServiceSettings
from murmur.node.pipeline.stage_sync import StageSync, outer_name
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import tls
from murmur.protocol.identity import Identity
from murmur.protocol.runconfig import OptimSection, SyncSection
from murmur.protocol.scratch_dirs import make_scratch_dir

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class StagePeerSettings:
    stages: int
    layers: list[int] | None
    seed: int
    optim: OptimSection
    target_samples: int
    grad_clip: float = 1.0
    replica_every_s: float = 0.0  # 0: keep no replica
    pipelined: bool = False  # the run config has a [pipeline] section: report to the coordinator, obey it
    sync: SyncSection | None = None  # the run's outer step, for the within-stage sync
    sync_every_s: float = 0.0  # 0: stage-mates do not sync (node/pipeline/stage_sync.py)
    # A round each time the run's ledger passes a multiple of this many samples (needs
    # ``tokens_committed``); 0: rounds on the clock every sync_every_s. pipeline.sync_every_samples.
    sync_every_samples: int = 0
    # At a clean stop, how long to wait for stage-mates that stop too before one last round with
    # them (node/pipeline/stop_sync.py); 0: no last round. The run's pipeline.stop_sync_s.
    stop_sync_s: float = 0.0
    sync_bucket_mb: float = 16.0  # a round's exchange in parts of this size (pipeline.sync_bucket_mb)
    host: str = "127.0.0.1"  # where both servers bind
    # Fixed ports to forward through a NAT (0: the kernel's choice): the stage service's (drivers
    # and the previous stage call it) and the peer server's (stage-mates sync and fetch state).
    port: int = 0
    state_port: int = 0
    advertise_host: str = ""  # what the coordinator is told to hand out (default: the bind host's rule)
    max_rows: int = 64
    device: str = "cpu"  # where the stage's weights live and compute runs: cpu, cuda, cuda:N
    autocast: str | None = None  # "bf16": bf16 autocast over fp32 master weights (node/pipeline/config.py)
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES  # one gRPC message; bigger payloads stream
    max_payload_bytes: int = 1 << 30  # the most one streamed payload may carry
    # a forward whose backward has not come this long is no longer awaited at the step boundary
    # (node/pipeline/step_gate.py): the run's pipeline.hop_timeout_s
    step_expire_s: float = 30.0
    lr_now: Callable[[], float] | None = None  # the run's schedule (node/pipeline/schedule.py); None: optim.lr
    heard: Callable[[int], None] | None = None  # a ledger total a driver told (the schedule's progress)
    state_dir: Path | None = None  # where the stage's checkpoints go (None: no checkpoints)
    checkpoint_every_s: float = 0.0  # on the clock (0: only at a clean stop)
    checkpoint_keep: int = stage_checkpoint.KEEP  # versions kept on disk per stage
    tokens_committed: Callable[[], int] | None = None  # the run's progress as the peer heard it last
    step_at: Callable[[int], int] | None = None  # the run's step at a ledger total (node/pipeline/schedule.py)
    run_config: dict | None = None  # kept in each checkpoint (the export's tokenizer and provenance)


class StagePeer:
    def __init__(
        self,
        ident: Identity,
        run_id: str,
        model: ModelConfig,
        settings: StagePeerSettings,
        *,
        member: PipelineMember | None = None,
        faults: FaultInjector | None = None,
        on_event: Callable[..., None] = lambda **_: None,
    ) -> None:
        self.ident, self.run_id, self.model, self.settings = ident, run_id, model, settings
        self.member, self.faults, self.on_event = member, faults, on_event
        self.spans = split_layers(model.n_layers, settings.stages, settings.layers)
        self.state_server = PeerServer(ident, run_id=run_id,
                                       settings=PeerServerSettings(host=settings.host, port=settings.state_port))
        self.state_address = ""
        self.service: StageService | None = None
        self.state_source = ""
        self.serving = False  # set once the first `_become` is done (wait_serving)
        self.fetched_from: list[str] = []
        self.moves = 0
        self._moving: asyncio.Task | None = None
        self._replica: replica.DiskState | None = None  # the next stage's weights, in a file
        self._replica_dir: Path | None = None
        self._replica_tmp = False  # a temporary folder of its own, removed at the stop
        self._replica_at = 0.0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.sync: StageSync | None = None
        self.publisher: stage_state.LivePublisher | None = None  # the stage's state as served now
        self._state_hash = ""  # the hash last reported (a published state's hash is taken when asked for)
        self.built_peak_rss_mb = 0.0
        self.checkpoints_written = 0
        self.last_checkpoint: stage_checkpoint.CheckpointFile | None = None
        self.loaded_checkpoint: stage_checkpoint.CheckpointFile | None = None  # the one a start loaded
        self._view: pb.StageMap | None = None  # the coordinator's, as `_sources` read it last (its kept set)
        self.final_sync = stop_sync.FinalRound()  # the last round at the stop (none run yet)

    @property
    def stage(self) -> int:
        return self.service.span.index if self.service is not None else -1

    @property
    def address(self) -> str:
        """The stage service's address as drivers should dial it ("" before it serves)."""
        return self._advertised(self.service.address) if self.service is not None and self.service.address else ""

    def _advertised(self, bound: str) -> str:
        return advertised_address(bound, self.settings.host, self.settings.advertise_host)

    @property
    def worker(self) -> StageWorker | None:
        return self.service.worker if self.service is not None else None

    # -- life --------------------------------------------------------------------------------------

    async def start(self, stage: int | None, donors: dict[str, str] | None = None) -> None:
        """Serve ``stage`` (None: wait for the coordinator's order). ``donors``: {node id: peer
        server address} to load the stage's state from (None: ask the coordinator)."""
        self.state_address = self._advertised(await self.state_server.start())
        s = self.settings
        if self.member is not None and s.pipelined and s.sync is not None and s.sync_every_s > 0 and s.stages:
            ledger = None
            if s.tokens_committed is not None:  # the run's samples: every committed one went through every stage
                ledger = lambda: s.tokens_committed() // self.model.seq_len  # noqa: E731
            self.sync = StageSync(self.state_server, s.sync, s.sync_every_s, self._mates, self.faults,
                                  bucket_mb=s.sync_bucket_mb, every_samples=s.sync_every_samples, ledger=ledger)
            self._tasks.append(asyncio.create_task(self.sync.run()))
        if stage is None and self.settings.state_dir is not None:
            stage = self._checkpointed_stage()  # a restart: the stage it holds a checkpoint of
        if self.member is not None and self.settings.pipelined and self.member.rejoined:
            # The coordinator still lists the killed process under this node id, at its dead
            # address: a report of no stage yet (-1) replaces that entry now, before the stage is
            # built and loaded, so no driver dials the dead address meanwhile. Orders wait (none
            # is heard until the stage is served).
            self.member.report = self.report
            await self.member.beat()
        if stage is not None:
            await self._become(stage, donors)
        if self.member is not None and self.settings.pipelined:
            self.member.report = self.report
            self.member.on_order = self._on_order
            await self.member.beat()
            if self.settings.replica_every_s > 0 and self.settings.stages > 1:
                self._tasks.append(asyncio.create_task(self._keep_replica()))
        if self.settings.state_dir is not None and self.settings.checkpoint_every_s > 0:
            self._tasks.append(asyncio.create_task(self._keep_checkpointing()))

    async def wait_serving(self) -> None:
        # Until the first `_become` is done, not until the service exists: it is assigned before its
        # server starts and before the state is loaded, and a peer reported ready then with no
        # state source (a CI run under load).
        while not self.serving:
            if self._moving is not None and self._moving.done():
                self._moving.result()  # a failed first load raises here
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stopping = True  # no more moves: a peer on its way out serves no new stage
        last_round = self.sync is not None and self.serving and self.settings.stop_sync_s > 0
        if self.sync is not None:
            await self.sync.drain(linger=not last_round)  # no stage-mate is left a sync round behind
        if last_round:
            # No more microbatches (drivers go on with a mate), then one last round with the mates
            # that stop too, so that their final checkpoints hold one state and an export of the
            # run is their average, not one mate's weights (node/pipeline/stop_sync.py).
            if self.service is not None:
                await self.service.stop()
            self.final_sync = await stop_sync.final_round(self.sync, self.settings.stop_sync_s)
            collect_cycles()  # a failed last round's tensors, before the final checkpoint (memory.collect_cycles)
        for task in [*self._tasks, *([self._moving] if self._moving else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.sync is not None:
            await self.sync.aclose()
        if self.settings.state_dir is not None and self.serving:
            try:  # the weights at the stop, under the version of the period it falls in
                await self.checkpoint(stage_checkpoint.version_at(time.time(), self.settings.checkpoint_every_s))
            except Exception as err:  # noqa: BLE001 - the periodic ones are still there
                log.warning("the checkpoint at the stop failed: %s", err)
        if self.service is not None:
            await self.service.stop()
        await self.state_server.stop()
        if self._replica_tmp and self._replica_dir is not None:
            shutil.rmtree(self._replica_dir, ignore_errors=True)

    def report(self) -> pb.StageReport:
        rep = pb.StageReport(stage=self.stage, state_address=self.state_address, state_source=self.state_source,
                             replica_stage=-1)
        if self.service is not None:
            info = self.service.info()
            rep.first_block, rep.end_block, rep.address = info.first_block, info.end_block, self.address
            rep.samples_per_s, rep.queue = info.samples_per_s, info.queue
            rep.optimizer_steps, rep.samples_total = info.optimizer_steps, info.samples_total
            published = self.state_server.states.get(stage_state.state_name(self.stage))
            if published is not None:
                with contextlib.suppress(stage_state.StateChanged):  # stepped before anyone asked: as last time
                    self._state_hash = published.state_hash.hex()
                rep.state_hash = self._state_hash
        if self._replica is not None:
            rep.replica_stage = int(self._replica.name.split("/")[1])
            rep.replica_hash, rep.replica_at = self._replica.state_hash.hex(), self._replica_at
        return rep

    # -- orders ------------------------------------------------------------------------------------

    def _on_order(self, order: pb.StageOrder) -> None:
        if order.stage == self.stage or self._stopping or (self._moving is not None and not self._moving.done()):
            return
        log.info("the coordinator moves this peer from stage %d to %d (%s)", self.stage, order.stage, order.reason)
        self._moving = asyncio.create_task(self._move(order.stage, order.reason))

    async def _move(self, stage: int, reason: str) -> None:
        old = self.stage
        t0 = time.monotonic()
        try:
            await self._become(stage, None)
        except Exception as err:
            if old < 0:
                raise  # the first load: wait_serving reports it and the peer stops
            # It keeps serving its old stage; the coordinator gives the move up after a while.
            log.warning("could not move from stage %d to %d: %s", old, stage, err)
            return
        self.moves += old >= 0
        self.on_event(event="stage", stage=stage, from_stage=old, reason=reason, source=self.state_source,
                      seconds=round(time.monotonic() - t0, 3), state_hash=self.report().state_hash)
        if self.member is not None and self.settings.pipelined:
            await self.member.beat()

    # -- becoming a stage --------------------------------------------------------------------------

    async def _become(self, stage: int, donors: dict[str, str] | None) -> None:
        span = self.spans[stage]
        module = build_stage(self.model, self.settings.seed, span, self.settings.device,
                             autocast_dtype=torch.bfloat16 if self.settings.autocast == "bf16" else None)
        self.built_peak_rss_mb = peak_rss_mb()  # before the worker's buffers: what building the stage cost
        source = "seed"
        outer = None
        if donors is None:
            donors, holders = await self._sources(stage)
        else:
            holders = {}
        try:
            if donors:
                self.fetched_from = await stage_state.fetch_into(module, self.ident, donors)
                source = "peers"
                if self.sync is not None:  # the stage's anchor and outer momentum, to agree in its next round
                    with contextlib.suppress(StateError):
                        outer, _ = await afetch(self.ident, donors, outer_name(stage))
        except StateError as err:
            log.warning("stage %d: could not fetch the state from its peers: %s", stage, err)
        optimizer_state = None
        kept = kept_stage.offered(self._view, stage) if source == "seed" else None
        if source == "seed":
            loaded = self._from_checkpoint(module, stage)
            if loaded is not None:
                source, optimizer_state, ckpt_outer = "checkpoint", loaded["optimizer"], loaded.get("outer")
                outer = ckpt_outer if outer is None else outer
                if kept is not None and kept_stage.behind(loaded, kept[0], self.settings.step_at) and \
                        await self._from_kept(module, kept):
                    source, optimizer_state, outer = "kept", None, None  # the newer state: the run's
                    self.loaded_checkpoint = None
        if source == "seed":
            source = await self._from_replica(module, stage, holders)
        if source == "seed" and kept is not None and await self._from_kept(module, kept):
            source = "kept"
        if source == "seed":
            source = await self._seed_allowed(module, stage)
        if source == "seed" and self.stage >= 0:  # a move (a first start from the seed is a new run's)
            log.warning("stage %d has no live peer and no replica: it starts from the seed's weights", stage)
        worker = StageWorker(module, self.settings.optim, target_samples=self.settings.target_samples,
                             grad_clip=self.settings.grad_clip)
        worker.lr_now = self.settings.lr_now
        if optimizer_state is not None:
            try:
                worker.optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError, RuntimeError) as err:  # a fresh AdamW still trains
                log.warning("stage %d: the checkpoint's optimizer state does not fit: %s", stage, err)
        old = self.service.worker if self.service is not None else None
        if self.service is None:
            self.service = StageService(self.ident, worker, run_id=self.run_id, faults=self.faults,
                                        on_progress=self.settings.heard,
                                        settings=StageServiceSettings(
                                            host=self.settings.host, port=self.settings.port,
                                            max_rows=self.settings.max_rows,
                                            max_message_bytes=self.settings.max_message_bytes,
                                            max_payload_bytes=self.settings.max_payload_bytes,
                                            step_expire_s=self.settings.step_expire_s))
            await self.service.start()
        else:
            self.service.switch(worker)
        if old is not None:
            old.on_step = None
            old.before_step = None
            if old.span.index != stage:
                self.state_server.unpublish_state(stage_state.state_name(old.span.index))
        if self._replica is not None and self._replica.name == stage_state.state_name(stage):
            self._replica.remove()
            self._replica = None  # it serves that stage now; the copy is its own state
        self.state_source = source
        publisher = self.publisher = stage_state.LivePublisher(worker)

        def first_state() -> stage_state.LiveState:
            with worker.lock:  # it may serve calls already
                return publisher.state()

        self.state_server.publish_state(await asyncio.to_thread(first_state))
        self.serving = True
        loop = asyncio.get_running_loop()
        # In the compute thread with the worker's lock held, after a step or a sync round: the hash
        # is taken there, where nothing can change the weights halfway through it, and the loop
        # only publishes it. The state is the live weights (stage_state.LiveState), not a copy:
        # before the next change, ``before_step`` copies it for the calls still reading it.
        worker.before_step = publisher.before_change
        worker.on_step = lambda: loop.call_soon_threadsafe(self._publish_if_current, worker, publisher.state())
        if self.sync is not None:
            if old is not None and old.span.index != stage:
                self.state_server.unpublish_state(outer_name(old.span.index))
            # A peer that found no peer serving the stage holds no sync state until a mate comes
            # (node/pipeline/stage_sync.py): an anchor and its published copies are three copies
            # of the stage that a stage of one peer never uses.
            self.sync.reset(worker, outer, alone=source != "peers")

    # -- the coordinator's kept set ----------------------------------------------------------------

    async def _from_kept(self, module, kept: tuple[pb.KeptState, pb.StageState]) -> bool:
        try:
            await kept_stage.restore(module, self.ident, *kept)
        except StateError as err:
            log.warning("stage %d: the coordinator's kept set could not be restored: %s", kept[1].stage, err)
            return False
        return True

    async def _seed_allowed(self, module, stage: int) -> str:
        """No copy of the stage anywhere: the seed's weights, where the run trained, only on the
        coordinator's word (node/pipeline/kept_stage.py); what it found meanwhile otherwise."""
        s = self.settings
        if self.member is None or not s.pipelined or s.step_at is None or self._view is None:
            return "seed"
        step = s.step_at(self._view.tokens_committed)
        if step <= 0:
            return "seed"  # a new run: the seed's weights are its state

        async def look() -> str:
            donors, _ = await self._sources(stage)
            if donors:
                with contextlib.suppress(StateError):
                    self.fetched_from = await stage_state.fetch_into(module, self.ident, donors)
                    return "peers"
            kept = kept_stage.offered(self._view, stage)
            return "kept" if kept is not None and await self._from_kept(module, kept) else "seed"

        return await kept_stage.seed_allowed(self.member.client, stage, step, wait=self.stage < 0, look=look)

    # -- checkpoints ------------------------------------------------------------------------------

    def _checkpointed_stage(self) -> int | None:
        c = stage_checkpoint.newest(self.settings.state_dir)
        if c is None:
            return None
        if c.stages != self.settings.stages or not 0 <= c.stage < self.settings.stages:
            log.warning("the state folder's checkpoint %s is of a %d-stage cut, this run has %d stages: not used",
                        c.path.name, c.stages, self.settings.stages)
            return None
        return c.stage

    def _from_checkpoint(self, module, stage: int) -> dict | None:
        """The newest checkpoint of ``stage`` in the state folder, loaded into ``module`` (None: there
        is none of this run and this cut, or it does not fit)."""
        if self.settings.state_dir is None:
            return None
        c = stage_checkpoint.newest(self.settings.state_dir, stage)
        if c is None or c.stages != self.settings.stages:
            return None
        try:
            state = stage_checkpoint.read(c.path)
            if state["run_id"] != self.run_id:
                log.warning("%s is of run %s, not %s: not used", c.path, state["run_id"], self.run_id)
                return None
            stage_state.load_into(module, state["params"])
        except (ValueError, StateError, KeyError) as err:
            log.warning("stage %d: the checkpoint %s could not be loaded: %s", stage, c.path, err)
            return None
        self.loaded_checkpoint = c
        log.info("stage %d: loaded checkpoint version %d (%s)", stage, c.version, c.path.name)
        return state

    async def _keep_checkpointing(self) -> None:
        every = self.settings.checkpoint_every_s
        while True:
            now = time.time()
            version = int(now // every) + 1
            await asyncio.sleep(version * every - now)
            if self.service is None or not self.serving:
                continue
            try:
                await self.checkpoint(version)
                continue
            except Exception as err:  # noqa: BLE001 - a full disk: say so, try again next period
                log.warning("checkpoint version %d failed: %s", version, err)
            collect_cycles()  # what the failed write held, in cycles with its exception (memory.collect_cycles)

    async def checkpoint(self, version: int) -> stage_checkpoint.CheckpointFile:
        """Write the stage as checkpoint ``version`` and report it to the coordinator."""
        worker = self.worker
        s = self.settings
        span = worker.span
        # The sync's outer state as last published: those tensors are copies no round changes
        # (a round publishes new ones), so the file takes them as they are.
        outer_state = self.state_server.states.get(outer_name(span.index)) if self.sync is not None else None
        outer = dict(outer_state.tensors) if outer_state is not None else None
        layers = [sp.end_block - sp.first_block for sp in self.spans]
        tokens = s.tokens_committed() if s.tokens_committed is not None else 0

        def write() -> tuple[stage_checkpoint.CheckpointFile, int, str]:
            with worker.lock:  # no step while the stage is read (stage_checkpoint.for_write)
                params, opt, hold = stage_checkpoint.for_write(worker.module, worker.optimizer)
                steps = worker.stats.optimizer_steps
                if hold:  # the live tensors themselves: written before the lock goes
                    return written(params, opt, steps)
            return written(params, opt, steps)  # host copies: the stage computes on meanwhile

        def written(params, opt, steps: int) -> tuple[stage_checkpoint.CheckpointFile, int, str]:
            state_hash = stage_checkpoint.params_hash(params)
            c = stage_checkpoint.write(
                s.state_dir, run_id=self.run_id, stage=span.index, stages=s.stages, version=version,
                model=self.model, layers=layers, params=params, optimizer=opt, outer=outer, state_hash=state_hash,
                tokens_committed=tokens, optimizer_steps=steps, run_config=s.run_config, keep=s.checkpoint_keep,
            )
            return c, steps, state_hash

        c, steps, params_hash = await asyncio.to_thread(write)
        self.checkpoints_written += 1
        self.last_checkpoint = c
        self.on_event(event="checkpoint", stage=span.index, version=version, optimizer_steps=steps)
        if self.member is not None and s.pipelined:
            try:
                await self.member.client.report_checkpoint(version, stage_state.state_name(span.index), params_hash)
            except Exception as err:  # noqa: BLE001 - the file is written; the ledger hears of the next one
                log.warning("checkpoint version %d not reported to the coordinator: %s", version, err)
        return c

    def _publish_if_current(self, worker: StageWorker, state: PublishedState) -> None:
        if self.service is not None and self.service.worker is worker:
            self.state_server.publish_state(state)

    async def _mates(self, stage: int) -> dict[str, str]:
        """{node: peer server address} of the peers serving ``stage`` now, this one included."""
        mates = {p.node_id: p.report.state_address for p in serving(await self.member.stages(), stage)}
        if self.stage == stage:
            mates[self.ident.node_id] = self.state_address
        return mates

    async def _sources(self, stage: int) -> tuple[dict[str, str], dict[str, str]]:
        """({node: state address} of the peers serving ``stage``, the same of those keeping a replica of it)."""
        if self.member is None or not self.settings.pipelined:
            return {}, {}
        try:
            view = await self.member.stages()
        except Exception as err:  # noqa: BLE001 - the coordinator may be away; load from the seed
            log.warning("could not ask the coordinator for stage %d's peers: %s", stage, err)
            return {}, {}
        self._view = view
        if self.settings.heard is not None:
            # The run's total before the stage is served: a sync by samples counts its rounds from
            # it (a restarted process has heard nothing yet), and so does the lr of its first step.
            self.settings.heard(view.tokens_committed)
        me = self.ident.node_id
        donors = {p.node_id: p.report.state_address for p in serving(view, stage) if p.node_id != me}
        holders = {p.node_id: p.report.state_address for p in view.peers
                   if p.node_id != me and p.report.replica_stage == stage and p.report.state_address}
        return donors, holders

    async def _from_replica(self, module, stage: int, holders: dict[str, str]) -> str:
        name = stage_state.state_name(stage)
        tensors = None
        if self._replica is not None and self._replica.name == name:
            try:  # its own copy, from its file (node/pipeline/replica.py)
                params = dict(module.named_stage_parameters())
                replica.check_fits(self._replica, params)
                await asyncio.to_thread(self._replica.load_into, params)
                return "replica"
            except (StateError, OSError) as err:
                log.warning("stage %d: its own replica could not be loaded: %s", stage, err)
        else:
            for node_id, address in holders.items():  # one at a time: replicas may differ in age
                try:
                    tensors, _ = await afetch(self.ident, {node_id: address}, name)
                    break
                except StateError as err:
                    log.warning("stage %d: the replica of %s could not be fetched: %s", stage, node_id, err)
        if tensors is None:
            return "seed"
        try:
            stage_state.load_into(module, tensors)
        except StateError as err:
            log.warning("stage %d: a replica did not fit: %s", stage, err)
            return "seed"
        return "replica"

    # -- replicas ----------------------------------------------------------------------------------

    async def _keep_replica(self) -> None:
        while True:
            await asyncio.sleep(self.settings.replica_every_s)
            if self.service is None:
                continue
            target = (self.stage + 1) % self.settings.stages
            try:
                await self._refresh_replica(target)
                continue
            except Exception as err:  # noqa: BLE001 - a failed copy is retried at the next period
                log.info("replica of stage %d not refreshed: %s", target, err)
            collect_cycles()  # a failed fetch's buffers, in cycles with its exception (memory.collect_cycles)

    async def _refresh_replica(self, target: int) -> None:
        peers = serving(await self.member.stages(), target)
        if not peers:
            return
        newest = max(peers, key=lambda p: p.report.optimizer_steps)
        name = stage_state.state_name(target)
        if self._replica is not None and self._replica.name == name and \
                self._replica.state_hash.hex() == newest.report.state_hash:
            return
        # No expected hash: the peer steps on, so the one it reported a moment ago may be gone;
        # what arrives is checked against the hash it serves now. It goes to a file as it arrives
        # (node/pipeline/replica.py): the replica costs this peer no memory.
        path = self._replica_folder() / f"replica-stage-{target}.bin"
        state = await replica.fetch_to_disk(self.ident, newest.node_id, newest.report.state_address, name, path)
        if target == self.stage:  # moved meanwhile
            return
        self._replica = state
        self._replica_at = time.time()
        self.state_server.publish_state(self._replica)

    def _replica_folder(self) -> Path:
        if self._replica_dir is None:
            if self.settings.state_dir is not None:
                self._replica_dir = Path(self.settings.state_dir) / "replica"
            else:
                self._replica_dir = make_scratch_dir("murmur-replica-")
                self._replica_tmp = True
        return self._replica_dir


def serving(view: pb.StageMap, stage: int) -> list[pb.StagePeerInfo]:
    """The peers of the coordinator's view that serve ``stage`` and publish its state."""
    return [p for p in view.peers if p.report.stage == stage and p.report.state_address and p.report.state_hash]
