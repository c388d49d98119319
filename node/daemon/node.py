"""The volunteer node's lifecycle: join -> data plane -> state -> lease -> train/exchange/commit -> leave.

Concurrency (DESIGN.md): one asyncio loop owns every socket (coordinator client, peer server,
DHT handle, metrics endpoint); training runs in one thread and talks to the loop only through
`asyncio.run_coroutine_threadsafe` (lease requests, blocking with a bound) and
`loop.call_soon_threadsafe` (commits and round records, fire and forget).

Stopping (SIGTERM, Ctrl+C, the run's end): the training thread finishes the step it is in and
returns; the tokens of a half-done window are *not* committed (they never reached the global
model, so the shard is re-leased from its committed offset and they are trained again). Then the
loop flushes the pending commits, releases the lease, leaves the coordinator and the DHT, and the
process exits 0 with no child process left.

Coordinator outage: heartbeats and commits fail, the node logs it once and keeps training on the
lease it holds; commits wait in the journal (state dir) and are replayed, in order, when the
coordinator answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from murmur.errors import MurmurError
from murmur.node.daemon.metrics import MetricsServer, NodeMetrics
from murmur.node.daemon.metrics import metrics_server as make_metrics_server
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import JoinInfo, PendingCommit, StateDir
from murmur.node.daemon.training import LeaseView, NodeTrainer, Segment, WindowResult
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.train.trainer import evaluate, resolve_device
from murmur.optim.exchange import ExchangeError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run
from murmur.protocol.runconfig import RunConfig, parse_config


class NodeError(MurmurError):
    pass


# gRPC codes that mean "the coordinator is not there right now" (keep going, retry later),
# as opposed to a refusal (drop the call's work and say why).
OUTAGE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    None,
}


def is_outage(err: CoordinatorError) -> bool:
    return err.code in OUTAGE_CODES


@dataclass(kw_only=True, slots=True)
class NodeOptions:
    coordinator: str
    token: str | None
    state_dir: Path
    data: Path | None = None  # default: the run config's data.path
    device: str = "auto"
    listen: str = "127.0.0.1:0"  # the peer gRPC server (data plane)
    advertise_host: str = ""  # the host peers should dial (default: the listen host)
    metrics_listen: str = "127.0.0.1:0"  # Prometheus /metrics; "off" disables it
    threads: int = 0  # torch threads (0: torch's default); 1 when several nodes share a machine
    max_rounds: int = 0  # stop after this many rounds (0: until the run's schedule ends)
    solo: bool = False  # a one-member exchange: train alone against the coordinator, no peers
    dht_peers: list[str] = field(default_factory=list)  # extra DHT bootstrap multiaddrs
    min_peers: int = 1  # wait (up to peers_wait_s) for this many peers before the first round
    settings: NodeSettings = field(default_factory=NodeSettings)
    log: Callable[[str], None] = print


def hardware() -> pb.Hardware:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return pb.Hardware(
            device=f"cuda:{props.name}",
            cpu_cores=os.cpu_count() or 0,
            accelerator_memory_bytes=props.total_memory,
        )
    mem = 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return pb.Hardware(device="cpu", cpu_cores=os.cpu_count() or 0, memory_bytes=mem)


class Node:
    def __init__(self, options: NodeOptions) -> None:
        self.o = options
        self.s = options.settings
        self.state = StateDir(options.state_dir)
        self.metrics = NodeMetrics()
        self.stop_event = threading.Event()  # set from the loop (signals), read by the training thread
        self.stop_reason = ""
        self.pending: deque[PendingCommit] = deque()
        self.lost_leases: set[str] = set()
        self.current_lease: LeaseView | None = None
        self.client: MemberClient | None = None
        self.info: JoinInfo | None = None
        self.cfg: RunConfig | None = None
        self.trainer: NodeTrainer | None = None
        self.dataplane: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._coordinator_up = True
        self._commit_wakeup: asyncio.Event | None = None
        self._run_finished = False
        self._ident: identity.Identity | None = None
        self._ratio_base_step = 0  # the step this node's byte counter started from
        self._tokens_per_s = 0.0

    # -- logging -----------------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        self.o.log(msg)

    def request_stop(self, reason: str) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            self.log(f"stopping ({reason}): finishing the current step, then commit, release, leave")
        self.stop_event.set()
        if self.trainer is not None:
            # A step waiting for its exchange would wait up to round_timeout_s: end the wait now.
            # Nothing partial is applied (the round fails as a whole) and the window is not committed.
            self.trainer.meter.abort(f"the node is stopping ({reason})")

    # -- joining -----------------------------------------------------------------------------------

    async def _join(self) -> tuple[JoinInfo, identity.Identity, str]:
        saved = self.state.load_join()
        if saved is not None and saved[0].coordinator == self.o.coordinator:
            info, ident, config = saved
            self.log(f"rejoining run {info.run_id} as {info.node_id} (identity from {self.state.root})")
            return info, ident, config
        if not self.o.token:
            raise NodeError(
                f"{self.state.root} holds no membership of the coordinator at {self.o.coordinator}: "
                "pass --token (from `murmur admin tokens create`)"
            )
        key = self.state.node_key()
        ident, joined = await join_run(
            self.o.coordinator,
            self.o.token,
            key,
            hardware=hardware(),
            timeout_s=self.s.join_timeout_s,
        )
        info = JoinInfo(
            node_id=joined.node_id,
            run_id=joined.run_id,
            coordinator=self.o.coordinator,
            node_address=joined.node_address,
            tls_server_name=joined.tls_server_name,
            bootstrap_peers=list(joined.bootstrap_peers),
            heartbeat_interval_s=joined.heartbeat_interval_s,
            heartbeat_ttl_s=joined.heartbeat_ttl_s,
            lease_ttl_s=joined.lease_ttl_s,
        )
        self.state.save_join(info, ident.cert_pem, ident.ca_cert_pem, joined.config_toml)
        self.log(f"joined run {info.run_id} as {info.node_id}")
        return info, ident, joined.config_toml

    # -- coordinator calls from the loop ---------------------------------------------------------

    async def _fresh_channel(self) -> None:
        """A new channel to the coordinator: gRPC backs off reconnecting up to minutes after an
        outage, while a node wants to notice the coordinator's return within outage_retry_s."""
        assert self.info is not None and self._ident is not None
        old = self.client
        self.client = MemberClient(
            self.info.node_address,
            self._ident,
            server_name=self.info.tls_server_name,
            timeout_s=self.s.rpc_timeout_s,
        )
        if old is not None:
            self.client.ban_list_version = old.ban_list_version
            with contextlib.suppress(Exception):
                await old.close()

    def _mark(self, up: bool, err: CoordinatorError | None = None) -> None:
        if up and not self._coordinator_up:
            self.log("coordinator is back: replaying pending commits")
        elif not up and self._coordinator_up:
            self.log(f"coordinator unreachable ({err}); training goes on, commits wait in the journal")
        self._coordinator_up = up
        self.metrics.coordinator_up = int(up)

    async def _heartbeats(self) -> None:
        assert self.client is not None and self.info is not None
        interval = self.info.heartbeat_interval_s or 1.0
        while not self.stop_event.is_set():
            try:
                reply = await self.client.heartbeat(self._tokens_per_s, "training")
                self._mark(True)
                if self._commit_wakeup is not None and self.pending:
                    self._commit_wakeup.set()
                if reply.heartbeat_interval_s > 0:
                    interval = reply.heartbeat_interval_s
                if reply.run_state == "finished":
                    self._run_finished = True
                    self.request_stop("the run is finished")
            except CoordinatorError as err:
                if is_outage(err):
                    self._mark(False, err)
                    await self._fresh_channel()
                else:
                    self.log(f"heartbeat refused: {err}")
            await self._sleep(interval)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when a stop is asked for."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop_async.wait(), seconds)

    async def _committer(self) -> None:
        assert self._commit_wakeup is not None
        while True:
            await self._flush_commits()
            if self.stop_event.is_set() and not self.pending:
                return
            self._commit_wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._commit_wakeup.wait(), self.s.outage_retry_s)
            if self._closing:
                return

    async def _flush_commits(self) -> bool:
        """Send pending commits in order; False if the coordinator is unreachable."""
        async with self._commit_lock:  # the committer task and the shutdown both flush
            return await self._flush_locked()

    async def _flush_locked(self) -> bool:
        assert self.client is not None
        while self.pending:
            c = self.pending[0]
            try:
                reply = await self.client.commit(
                    c.lease_id,
                    c.shard_id,
                    c.start_offset,
                    c.end_offset,
                    outer_step=c.outer_step,
                    loss=c.loss,
                    bytes_sent=c.bytes_sent,
                    seconds=c.seconds,
                )
                self._mark(True)
                self.metrics.commits_total += 1
                if reply.shard_done and self.current_lease and self.current_lease.lease_id == c.lease_id:
                    pass  # the training thread already moved on when the shard ran out
            except CoordinatorError as err:
                if is_outage(err):
                    self._mark(False, err)
                    return False
                # Refused (lease expired and re-leased, a span out of order): this work is counted
                # by whoever holds the shard now. Drop it and the lease's later commits.
                self.log(f"commit of shard {c.shard_id} [{c.start_offset}, {c.end_offset}) refused: {err}")
                self.lost_leases.add(c.lease_id)
            self.pending.popleft()
            self._save_journal()
        return True

    def _save_journal(self) -> None:
        self.state.save_pending(list(self.pending))
        self.metrics.pending_commits = len(self.pending)

    async def _acquire(self) -> LeaseView | None:
        assert self.client is not None
        while not self.stop_event.is_set():
            # The coordinator hands back a held lease until its shard is done: commits first.
            if not await self._flush_commits():
                await self._sleep(self.s.outage_retry_s)
                continue
            try:
                reply = await self.client.acquire()
                self._mark(True)
            except CoordinatorError as err:
                if not is_outage(err):
                    raise NodeError(f"the coordinator refused a lease: {err}") from None
                self._mark(False, err)
                await self._sleep(self.s.outage_retry_s)
                continue
            if reply.granted:
                lease = reply.lease
                if lease.lease_id in self.lost_leases:
                    self.lost_leases.discard(lease.lease_id)
                view = LeaseView(
                    lease.lease_id, int(lease.shard_id), int(lease.start_offset), int(lease.end_offset)
                )
                self.current_lease = view
                self.log(
                    f"leased shard {view.shard_id} from offset {view.start_offset:,} "
                    f"({view.end_offset - view.start_offset:,} tokens left)"
                )
                return view
            if "done" in reply.reason or "finished" in reply.reason:
                self._run_finished = True
                self.request_stop(f"nothing left to train: {reply.reason}")
                return None
            await self._sleep(self.s.lease_wait_s)
        return None

    # -- training thread side ---------------------------------------------------------------------

    def _next_lease_blocking(self, done: Segment | None, loss: float) -> LeaseView | None:
        """From the training thread: commit the shard that ran out, then wait for a new lease."""
        assert self.loop is not None and self.trainer is not None
        if done is not None and done.end > done.start:
            commit = PendingCommit(
                done.lease.lease_id,
                done.lease.shard_id,
                done.start,
                done.end,
                self.trainer.round,
                loss if math.isfinite(loss) else 0.0,
                self.trainer.sync.bytes.total_sent,
                0.0,
            )
            self.loop.call_soon_threadsafe(self._queue_commits, [commit])
        return asyncio.run_coroutine_threadsafe(self._acquire(), self.loop).result()

    def _train(self) -> None:
        """The training thread: windows until a stop, the schedule's end or max_rounds."""
        assert self.trainer is not None and self.cfg is not None and self.loop is not None
        if self.o.threads:
            torch.set_num_threads(self.o.threads)
        trainer, cfg = self.trainer, self.cfg
        val = eval_batches(trainer.dataset, trainer.batch, trainer.seq_len, cfg.train.eval_batches)
        eval_every = max(1, round(cfg.train.eval_every / trainer.h))  # in rounds
        if trainer.round == 0:
            v = evaluate(trainer.model, val, trainer.device, cfg.train.dtype)
            self.loop.call_soon_threadsafe(self._record_start, v)
        rounds_here = 0
        while not self.stop_event.is_set():
            if trainer.step >= cfg.train.steps:
                why = f"the run's schedule of {cfg.train.steps} steps is done"
                self.loop.call_soon_threadsafe(self.request_stop, why)
                break
            if trainer.lease is not None and trainer.lease.lease_id in self.lost_leases:
                trainer.lease, trainer.loader = None, None  # its work is refused: take a new lease
            try:
                result = trainer.run_window(self._next_lease_blocking, self.stop_event.is_set)
            except ExchangeError as err:
                if self.stop_event.is_set():
                    break
                # Nothing partial was applied. Re-sync from peers; the window's tokens are
                # trained again (the lease restarts from its committed offset).
                self.loop.call_soon_threadsafe(
                    self.log, f"round {trainer.round + 1} failed ({err}); re-syncing"
                )
                trainer.lease, trainer.loader = None, None
                self._resync_blocking()
                continue
            if result.stopped:
                break
            rounds_here += 1
            v = None
            if result.round % eval_every == 0 or trainer.step >= cfg.train.steps:
                v = evaluate(trainer.model, val, trainer.device, cfg.train.dtype)
            record = self._round_record(result, v)
            commits = [
                PendingCommit(
                    seg.lease.lease_id,
                    seg.lease.shard_id,
                    seg.start,
                    seg.end,
                    result.round,
                    result.loss,
                    record["bytes_sent"],
                    result.seconds,
                )
                for seg in result.segments
                if seg.end > seg.start
            ]
            shared = trainer.shared_tensors()
            ckpt = None
            if self.s.checkpoint_every_rounds and result.round % self.s.checkpoint_every_rounds == 0:
                ckpt = trainer.state_dict()
            if ckpt is not None:
                # Before the round is logged or committed: the checkpoint is never older than either.
                self.state.save_checkpoint(ckpt)
            self.loop.call_soon_threadsafe(self._after_round, record, commits, shared)
            if self.o.max_rounds and rounds_here >= self.o.max_rounds:
                self.loop.call_soon_threadsafe(self.request_stop, f"--max-rounds {self.o.max_rounds} reached")
                break

    def _resync_blocking(self) -> None:
        assert self.loop is not None and self.trainer is not None
        fetch = getattr(self.dataplane, "fetch_state", None)
        if fetch is None:
            return
        coro = fetch(min_round=self.trainer.round, timeout_s=self.s.state_fetch_timeout_s)
        state = asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        if state is not None:
            self.trainer.load_shared_tensors(state)
            self.loop.call_soon_threadsafe(self.log, f"re-synced to round {self.trainer.round} from peers")

    def _round_record(self, result: WindowResult, val: float | None) -> dict[str, Any]:
        assert self.trainer is not None
        t = self.trainer
        sent = t.sync.bytes.total_sent
        peers = getattr(self.dataplane, "last_round_members", lambda: [])()
        k = max(2, len(peers))
        ddp = (t.step - self._ratio_base_step) * (2 * (k - 1) * 4 * t.n_params // k)
        return {
            "round": result.round,
            "step": t.step,
            "time": time.time(),
            "node": self.info.node_id if self.info else "",
            "loss": result.loss,
            "val_loss": val,
            "tokens": result.tokens,
            "tokens_per_s": result.tokens / result.seconds if result.seconds > 0 else 0.0,
            "seconds": result.seconds,
            "compute_seconds": result.compute_seconds,
            "bytes_sent": sent,
            "bytes_received": t.sync.bytes.total_received,
            "compression": ddp / sent if sent else 0.0,
            "peers": len(peers),
            "hash": t.global_hash(),
            "shards": [s.lease.shard_id for s in result.segments],
        }

    # -- loop side of a round ---------------------------------------------------------------------

    def _queue_commits(self, commits: list[PendingCommit]) -> None:
        for c in commits:
            if len(self.pending) >= self.s.max_pending_commits:
                self.log(f"more than {self.s.max_pending_commits} commits pending: dropping the oldest")
                self.pending.popleft()
            self.pending.append(c)
        self._save_journal()
        if self._commit_wakeup is not None:
            self._commit_wakeup.set()

    def _record_start(self, val: float) -> None:
        self.state.append_round(
            {
                "round": 0,
                "step": 0,
                "time": time.time(),
                "val_loss": val,
                "node": self.info.node_id if self.info else "",
                "hash": self.trainer.global_hash() if self.trainer else "",
            }
        )
        self.log(f"round    0 | val {val:.4f}")

    def _after_round(self, record: dict[str, Any], commits: list[PendingCommit], shared: list | None) -> None:
        m = self.metrics
        m.round, m.steps, m.loss = record["round"], record["step"], record["loss"]
        m.tokens_per_s, m.tokens_total = record["tokens_per_s"], m.tokens_total + record["tokens"]
        m.bytes_sent_total, m.bytes_received_total = record["bytes_sent"], record["bytes_received"]
        m.compression_ratio, m.peers = record["compression"], record["peers"]
        m.compute_seconds_total += record["compute_seconds"]
        m.wall_seconds_total += record["seconds"]
        self._tokens_per_s = record["tokens_per_s"]
        self._queue_commits(commits)
        if shared is not None and hasattr(self.dataplane, "publish"):
            self.dataplane.publish(record["round"], shared)
        self.state.append_round(record)
        ratio = f"{record['compression']:,.0f}x" if record["compression"] else "-"
        val = f" | val {record['val_loss']:.4f}" if record["val_loss"] is not None else ""
        self.log(
            f"round {record['round']:4d} | loss {record['loss']:.4f}{val}"
            f" | {record['tokens_per_s']:,.0f} tok/s"
            f" | sent {record['bytes_sent'] / 1e6:.2f} MB | {ratio} less than ddp | peers {record['peers']}"
            f" | {'coordinator ok' if self._coordinator_up else 'coordinator DOWN'}"
        )

    # -- the whole life ----------------------------------------------------------------------------

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self._stop_async = asyncio.Event()
        self._closing = False
        self._commit_wakeup = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self.loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        watcher = asyncio.create_task(self._watch_stop())
        self.state.lock()
        tasks: list[asyncio.Task] = []
        metrics_server: MetricsServer | None = None
        try:
            info, ident, config_toml = await self._join()
            self.info = info
            self.cfg = cfg = parse_config(config_toml, "the run configuration")
            data_path = self.o.data or Path(cfg.data.path)
            dataset = Dataset.open(data_path)
            if dataset.tokenizer != cfg.data.tokenizer:
                raise NodeError(
                    f"{data_path} holds {dataset.tokenizer} tokens but the run uses {cfg.data.tokenizer}"
                )
            self._ident = ident
            await self._fresh_channel()
            self.pending.extend(self.state.load_pending())
            self.metrics.pending_commits = len(self.pending)
            if self.o.metrics_listen != "off":
                host, _, port = self.o.metrics_listen.rpartition(":")
                metrics_server = make_metrics_server(self.metrics, {"node": info.node_id, "run": info.run_id})
                bound = await metrics_server.start(host or "127.0.0.1", int(port or 0))
                self.log(f"metrics on http://{host or '127.0.0.1'}:{bound}/metrics")
            from murmur.node.daemon import dataplane  # gRPC peer server, DHT, exchange

            self.dataplane = await dataplane.open_dataplane(
                ident=ident,
                info=info,
                cfg=cfg,
                settings=self.s,
                listen=self.o.listen,
                advertise_host=self.o.advertise_host,
                log=self.log,
                solo=self.o.solo,
                dht_peers=self.o.dht_peers,
                state_dir=self.state.root,
            )
            device = resolve_device(self.o.device)
            if self.o.threads:
                torch.set_num_threads(self.o.threads)
            self.trainer = NodeTrainer(
                cfg, dataset, device, self.dataplane.exchange, round_timeout_s=self.s.round_timeout_s
            )
            if self.o.min_peers > 1 and not self.stop_event.is_set():
                seen = await self.dataplane.wait_for_peers(
                    self.o.min_peers, self.s.peers_wait_s, self.stop_event.is_set
                )
                self.log(f"{seen} peer(s) announced (waited for {self.o.min_peers})")
            if self.stop_event.is_set():
                return 0
            await self._restore()
            self.log(
                f"node {info.node_id}: {cfg.sync.algorithm} codec={cfg.sync.codec} H={cfg.sync.inner_steps} "
                f"model {cfg.model.preset} ({self.trainer.n_params / 1e6:.2f}M params) on {device}, "
                f"from round {self.trainer.round}"
            )
            tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._committer())]
            await asyncio.to_thread(self._train)
            return 0
        finally:
            if not self.stop_event.is_set():  # the run ended or failed: no "stopping" line
                self.stop_reason = self.stop_reason or "shutting down"
                self.stop_event.set()
            await self._shutdown(tasks)
            watcher.cancel()
            if metrics_server is not None:
                await metrics_server.stop()
            self.state.unlock()

    async def _watch_stop(self) -> None:
        await asyncio.to_thread(self.stop_event.wait)
        self._stop_async.set()

    async def _restore(self) -> None:
        """Local checkpoint first; then peers, if the run has moved on (or for a first join)."""
        assert self.trainer is not None
        ckpt = self.state.load_checkpoint()
        if ckpt is not None:
            try:
                self.trainer.load_state_dict(ckpt)
                self.log(f"resumed from the local checkpoint at round {self.trainer.round}")
            except (MurmurError, KeyError, RuntimeError) as err:
                self.log(f"local checkpoint not usable ({err}); asking peers for the state")
        fetch = getattr(self.dataplane, "fetch_state", None)
        if fetch is None:
            return
        state = await fetch(min_round=self.trainer.round + 1, timeout_s=self.s.state_fetch_timeout_s)
        if state is not None:
            self.trainer.load_shared_tensors(state)
            self._ratio_base_step = self.trainer.step  # this node's bytes count from here
            self.log(f"took the global state of round {self.trainer.round} from peers")
        self.dataplane.publish(self.trainer.round, self.trainer.shared_tensors())

    async def _shutdown(self, tasks: list[asyncio.Task]) -> None:
        """Commit, release, leave; each step bounded so a dead coordinator cannot hold the exit."""
        deadline = time.monotonic() + self.s.shutdown_grace_s

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        self._stop_async.set()
        if self.client is not None:
            with contextlib.suppress(asyncio.TimeoutError, CoordinatorError):
                await asyncio.wait_for(self._flush_commits(), left())
            self._closing = True
            if self._commit_wakeup is not None:
                self._commit_wakeup.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.pending:
                self.log(f"{len(self.pending)} commits still pending (kept in {self.state.journal_path})")
            lease = self.current_lease
            if lease is not None and lease.lease_id not in self.lost_leases:
                with contextlib.suppress(asyncio.TimeoutError, CoordinatorError):
                    await asyncio.wait_for(self.client.release(lease.lease_id), left())
                    self.log(f"released the lease on shard {lease.shard_id}")
            if not self.pending:
                try:
                    await asyncio.wait_for(self.client.leave(self.stop_reason[:200]), left())
                    self.state.forget_join()  # a left node joins afresh next time
                    self.log("left the run")
                except (TimeoutError, CoordinatorError) as err:
                    self.log(
                        f"could not say goodbye to the coordinator ({err}); its lease expires on its own"
                    )
            with contextlib.suppress(Exception):
                await self.client.close()
        else:
            for t in tasks:
                t.cancel()
        if self.dataplane is not None:
            try:
                await self.dataplane.close()  # bounds its own steps; always stops the DHT's processes
            except Exception as err:  # noqa: BLE001 - closing must go on whatever the data plane says
                print(f"warning: data plane did not close cleanly: {err!r}", file=sys.stderr)


def run_node(options: NodeOptions) -> int:
    return asyncio.run(Node(options).run())
