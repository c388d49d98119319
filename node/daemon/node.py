"""The volunteer node's lifecycle: join -> data plane -> state -> lease -> train/exchange/commit -> leave.

`Node` wires three parts and owns the run from start to exit:

    CoordinatorSession   join, heartbeats, leases, the commit journal and its replay, outages
                         (node/daemon/session.py)
    DataPlane            solo, or the peer server + DHT + gRPC exchange (node/daemon/dataplane.py)
    TrainingThread       the training thread and its bridge to the loop, restore, round records
                         (node/daemon/training_thread.py)

Concurrency: one asyncio loop owns every socket (coordinator client, peer server, DHT handle,
metrics endpoint); training runs in one thread and talks to the loop only through
`asyncio.run_coroutine_threadsafe` (lease requests and state fetches, which it waits for) and
`loop.call_soon_threadsafe` (commits, round records and stop requests, fire and forget).

Stopping (SIGTERM, Ctrl+C, the run's end): the training thread finishes the step it is in and
returns; the tokens of a half-done window are *not* committed (they never reached the global
model, so the shard is re-leased from its committed offset and they are trained again). Then the
loop flushes the pending commits, releases the lease, leaves the coordinator and the DHT, and the
process exits 0 with no child process left. Each of those steps is bounded by shutdown_grace_s.

Coordinator outage: heartbeats and commits fail, the node logs it once and keeps training on the
lease it holds; commits wait in the journal (state dir) and are replayed, in order, when the
coordinator answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from murmur.errors import MurmurError
from murmur.node.daemon.dataplane import DataPlane, SoloDataPlane
from murmur.node.daemon.metrics import MetricsServer, NodeMetrics
from murmur.node.daemon.metrics import metrics_server as make_metrics_server
from murmur.node.daemon.ranks import LocalRanks, RankError
from murmur.node.daemon.session import CoordinatorSession, join
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.start_times import StartTimes
from murmur.node.daemon.state_dir import JoinRecord, StateDir
from murmur.node.daemon.stop import StopSignal
from murmur.node.daemon.training_thread import Prepared, TrainingThread, prepare
from murmur.node.model.data import Dataset
from murmur.node.net.faults import FaultInjector
from murmur.node.net.member_folder import saved_membership
from murmur.node.pipeline import stage_checkpoint
from murmur.node.train.build import resolve_device
from murmur.protocol import identity
from murmur.protocol.runconfig import RunConfig, parse_config

if TYPE_CHECKING:
    import torch


class NodeError(MurmurError):
    pass


class PipelinedRun(Exception):  # noqa: N818 - a hand-over, not a failure
    """The run joined is pipelined (or ``--role`` asks for a pipeline role): not this node's to
    train. The membership stays in the state folder for node/daemon/pipeline_role.py, which
    serves a stage or drives; ``stopped``: a SIGTERM came while the node joined."""

    def __init__(self, run_id: str, stopped: bool, rejoined: bool = False) -> None:
        super().__init__(run_id)
        # rejoined: the node joined with its folder's saved membership (a restart)
        self.run_id, self.stopped, self.rejoined = run_id, stopped, rejoined


@dataclass(kw_only=True, slots=True)
class NodeOptions:
    coordinator: str
    token: str | None
    state_dir: Path
    data: Path | None = None  # default: the run config's data.path
    device: str = "auto"
    name: str = ""  # the volunteer's name for this node (--name), shown beside its id
    listen: str = "127.0.0.1:0"  # the peer gRPC server (data plane)
    advertise_host: str = ""  # the host peers should dial (default: the listen host)
    metrics_listen: str = "127.0.0.1:0"  # Prometheus /metrics; "off" disables it
    threads: int = 0  # torch threads (0: torch's default); 1 when several nodes share a machine
    max_rounds: int = 0  # stop after this many rounds (0: until the run's schedule ends)
    solo: bool = False  # a one-member exchange: train alone against the coordinator, no peers
    dht_peers: list[str] = field(default_factory=list)  # extra DHT bootstrap multiaddrs
    min_peers: int = 1  # wait (up to peers_wait_s) for this many peers before the first round
    # "auto": the coordinator dials the peer server back and the node takes client mode if nobody
    # can reach it (protocol/reachability.py); "on": client mode; "off": fail if it is unreachable.
    client_mode: str = "auto"
    # Local ranks: this process and gpus-1 followers train data parallel (node/daemon/ranks.py):
    # one GPU each on a CUDA node (NCCL), CPU processes otherwise (gloo; the tests).
    gpus: int = 1
    settings: NodeSettings = field(default_factory=NodeSettings)
    faults: FaultInjector | None = None  # --fault: armed in this node's exchange (tests, chaos)
    role: str = "auto"  # --role: a pipelined run is handed over (PipelinedRun); stage or driver want one
    log: Callable[[str], None] = print


class Node:
    def __init__(self, options: NodeOptions) -> None:
        self.o = options
        self.s = options.settings
        self.log = options.log
        self.state = StateDir(options.state_dir)
        self.metrics = NodeMetrics()
        self.stop = StopSignal(self.log)
        # Built in this order by run(), once what each needs is known; None until then.
        self.session: CoordinatorSession | None = None
        self.metrics_server: MetricsServer | None = None
        self.dataplane: DataPlane | None = None
        self.training: TrainingThread | None = None
        self.ranks: LocalRanks | None = None
        self.leave_on_exit = True  # say Leave (and forget the join record) when the node exits
        self.times = StartTimes()  # reset when run() starts

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.request, signal.Signals(sig).name)
        self.times = StartTimes()
        self.state.lock()
        try:
            try:
                started = await self._start()
            except BaseException:
                # A node that could not start (the DHT, the data, a peer) keeps its membership: a
                # restart rejoins as the same node instead of needing a new token.
                self.leave_on_exit = False
                raise
            if not started:
                return 0
            assert self.session is not None and self.training is not None
            try:
                await asyncio.to_thread(self.training.train)
            except RankError:
                # A local rank died: stop cleanly, keep the membership; a restart resumes from the checkpoint.
                self.leave_on_exit = False
                raise
            return 0
        finally:
            self.stop.settle("shutting down")  # the run ended or failed: no "stopping" line
            await self._shutdown()
            self.state.unlock()

    async def _start(self) -> bool:
        """Join, open the data plane, build the trainer and take the newest state; False when a
        stop came before there was anything to train."""
        # The node's own inputs first: a bad device or data folder costs no use of the join token
        # and leaves no member behind in the coordinator's ledger.
        device = resolve_device(self.o.device)
        checked = self._data_before_join()
        # A checkpoint that is not the one written (overwritten in place, cut short) is refused here,
        # before the join: nothing is trained from it and the ledger does not hear of this start.
        if self.state.verify_checkpoint() is False:
            self.log(f"warning: {self.state.checkpoint_path} was written before checkpoints carried a checksum: "
                     "it is read unchecked (the next checkpoint carries one)")
        stage_checkpoint.verify_folder(self.state.root)  # a stage peer's (a pipelined run's node)
        rejoining = saved_membership(self.state, self.o.coordinator) is not None
        info, ident, config_toml = await join(
            self.o.coordinator, self.o.token, self.state, self.s, self.log, name=self.o.name
        )
        self.times.joined = self.times.now()
        # From here on a SIGTERM ends the start at the next step, or cuts the data plane's start
        # short: the node leaves within shutdown_grace_s of it (issue 50: it used to start its DHT
        # and build its model first, and exited 15 s after the signal).
        cfg = parse_config(config_toml, "the run configuration")
        if cfg.pipeline is not None:  # never trained data parallel: a stage or a driver instead
            raise PipelinedRun(info.run_id, self.stop.is_set(), rejoining)
        if self.o.role != "auto":
            raise NodeError(f"run {info.run_id} is not pipelined (its config has no [pipeline] section): "
                            f"--role {self.o.role} needs one; leave --role out to train it data parallel")
        data_path = self.o.data or Path(cfg.data.path)
        dataset = checked if checked is not None and checked.root == data_path else Dataset.open(data_path)
        if dataset.tokenizer != cfg.data.tokenizer:
            raise NodeError(f"{data_path} holds {dataset.tokenizer} tokens but the run uses {cfg.data.tokenizer}")
        self.session = CoordinatorSession(
            info, ident, settings=self.s, state=self.state, metrics=self.metrics, stop=self.stop, log=self.log
        )
        if self.o.metrics_listen != "off":
            host, _, port = self.o.metrics_listen.rpartition(":")
            self.metrics_server = make_metrics_server(self.metrics, {"node": info.node_id, "run": info.run_id})
            bound = await self.metrics_server.start(host or "127.0.0.1", int(port or 0))
            self.log(f"metrics on http://{host or '127.0.0.1'}:{bound}/metrics")
        self.session.in_rounds = not self.o.solo
        if self.stop.is_set():
            return False
        await self.session.starting()
        # The trainer is built and the checkpoint read while the data plane starts: from the moment
        # the DHT's process is forked (nothing may run under that fork: protocol/fork_guard.py) to
        # the moment it is ready, seconds of every restart. With local ranks, after them (the
        # trainer steps with them).
        loop = asyncio.get_running_loop()
        forked = asyncio.Event()
        opening = asyncio.ensure_future(self.stop.unless_stopped(
            self._open_dataplane(info, ident, cfg, on_forked=lambda: loop.call_soon_threadsafe(forked.set))
        ))
        preparing: asyncio.Future[Prepared] | None = None
        try:
            if self.o.gpus == 1:
                await _first_of(opening, forked.wait())
                if not self.stop.is_set() and not (opening.done() and opening.exception() is not None):
                    preparing = asyncio.ensure_future(self._prepare(cfg, dataset, device, info))
            self.dataplane = await opening
            self.times.dataplane = self.times.now()
            if self.stop.is_set():
                return False
            assert self.dataplane is not None
            # Heartbeats from now on (not before: hivemind forks its DHT process, which must not happen
            # under live gRPC calls); their replies carry the run's live trainers, which the data
            # plane's rendezvous and a joiner's state fetch check the DHT against (run_view.py).
            self.session.start()
            if self.o.gpus > 1:
                self.ranks = await asyncio.to_thread(
                    LocalRanks, self.o.gpus, device, str(self.state.root / "config.toml"), dataset.vocab_size,
                    self.o.threads,
                )
                self.log(f"{self.o.gpus} local ranks ({'NCCL' if device.type == 'cuda' else 'gloo'}): "
                         f"{cfg.train.batch_size} rows per rank per step")
            if self.stop.is_set():
                return False
            if preparing is None:
                preparing = asyncio.ensure_future(self._prepare(cfg, dataset, device, info))
            prepared = await preparing
        finally:
            # A start that ends here (a stop, a failure) still waits for the build's thread: the
            # trainer it makes is let go, and no exception of it goes unread.
            if preparing is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(preparing)
        self.training = TrainingThread(
            cfg=cfg,
            prepared=prepared,
            dataplane=self.dataplane,
            session=self.session,
            state=self.state,
            metrics=self.metrics,
            stop=self.stop,
            settings=self.s,
            threads=self.o.threads,
            max_rounds=self.o.max_rounds,
            log=self.log,
            faults=self.o.faults,
        )
        # The coordinator's first view of the run's trainers, before counting peers (it tells a
        # live peer's record from one a node that just left or died left behind in the DHT).
        with contextlib.suppress(TimeoutError):  # a coordinator outage: the DHT alone decides
            await asyncio.wait_for(self.session.viewed.wait(), self.s.rpc_timeout_s)
        if self.o.min_peers > 1 and not self.stop.is_set():
            seen = await self.dataplane.wait_for_peers(self.o.min_peers, self.s.peers_wait_s, self.stop.is_set)
            self.log(f"{seen} peer(s) announced (waited for {self.o.min_peers})")
        if self.stop.is_set():
            return False
        await self.training.restore()
        self.times.restored = self.times.now()
        self.log(
            f"node {info.node_id}: {cfg.sync.algorithm} codec={cfg.sync.codec} H={cfg.sync.inner_steps} "
            f"model {cfg.model.preset} ({self.training.trainer.n_params / 1e6:.2f}M params) on {device}, "
            f"from round {self.training.trainer.round}; {self.times.line()}"
        )
        return True

    async def _prepare(self, cfg: RunConfig, dataset: Dataset, device: torch.device, info: JoinRecord) -> Prepared:
        began = time.monotonic()
        prepared = await prepare(
            cfg=cfg, dataset=dataset, device=device, state=self.state, node_id=info.node_id, settings=self.s,
            threads=self.o.threads, ranks=self.ranks, faults=self.o.faults,
        )
        self.times.prepare_s = round(time.monotonic() - began, 2)
        return prepared

    def _data_before_join(self) -> Dataset | None:
        """The dataset, opened before joining where its folder is known: ``--data``, or the run
        config this state folder saved when it joined this coordinator. A first join without
        ``--data`` learns the folder (the run's data.path) only from the coordinator."""
        if self.o.data is not None:
            return Dataset.open(self.o.data)
        saved = self.state.load_join()
        if saved is not None and saved[0].coordinator == self.o.coordinator:
            cfg = parse_config(saved[2], "the saved run configuration")
            if cfg.pipeline is not None:  # a stage peer needs no data; a driver checks its own
                return None
            return Dataset.open(cfg.data.path)
        return None

    async def _open_dataplane(self, info: JoinRecord, ident: identity.Identity, cfg: RunConfig,
                              on_forked: Callable[[], object] | None = None) -> DataPlane:
        if self.o.solo:
            self.log("solo mode: a one-member exchange, no peer server, no DHT")
            return SoloDataPlane(info.node_id, cfg)
        from murmur.node.daemon import peer_dataplane  # hivemind and the gRPC peer stack: only when used

        plane = await peer_dataplane.open_peer_dataplane(
            ident=ident,
            info=info,
            cfg=cfg,
            settings=self.s,
            listen=self.o.listen,
            advertise_host=self.o.advertise_host,
            log=self.log,
            dht_peers=list(self.o.dht_peers),
            state_dir=self.state.root,
            faults=self.o.faults,
            refresh_bootstrap=self.session.bootstrap_peers if self.session is not None else None,
            view=self.session.view if self.session is not None else None,
            client_mode=self.o.client_mode,
            dial_back=self.session.check_reachable if self.session is not None else None,
            gate=self.session,  # the coordinator grants each round's group before it is applied
            on_forked=on_forked,
        )
        if self.session is not None:
            plane.on_publish = self.session.published  # heartbeats report round, hash, address
            self.session.on_coordinator_back = plane.coordinator_back  # the DHT heals after its restart
        return plane

    async def _shutdown(self) -> None:
        """Commit, release, leave (bounded by shutdown_grace_s), then close the data plane."""
        deadline = time.monotonic() + self.s.shutdown_grace_s

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        if self.session is not None:
            await self.session.close(left, leave=self.leave_on_exit)
        if self.dataplane is not None:
            try:
                await self.dataplane.close()  # bounds its own steps; always stops the DHT's processes
            except Exception as err:  # noqa: BLE001 - closing must go on whatever the data plane says
                print(f"warning: data plane did not close cleanly: {err!r}", file=sys.stderr)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.ranks is not None:
            codes = await asyncio.to_thread(self.ranks.stop)
            if any(codes):
                self.log(f"local ranks exited with {codes}")


async def _first_of(task: asyncio.Future[object], other: Awaitable[object]) -> None:
    """Until ``task`` is done or ``other`` is; ``other`` is called off if it is not."""
    waiter = asyncio.ensure_future(other)
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def run_node(options: NodeOptions) -> int:
    return asyncio.run(Node(options).run())
