"""The coordinator process: one asyncio loop owning the gRPC server, the sweeper and the HTTP port
(status page, /api/status, /metrics: status/http.py).

Two gRPC listeners share one server and one servicer:
  public  (``--listen``)       server-side TLS: Join and the admin calls;
  node    (``--node-listen``)  mutual TLS with the run CA: heartbeats, leases, commits.
On start it prints one JSON line on stdout (``{"event": "listening", ...}``) with every bound
address, so scripts and tests can bind port 0 and read what they got.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from murmur.errors import MurmurError
from murmur.logline import line_writer
from murmur.protocol import coordinator_pb2_grpc as pb_grpc
from murmur.protocol import malformed, tls

from . import authority, kept_server
from .discovery import Discovery
from .fronts import HeartbeatFronts
from .heartbeat_udp import HeartbeatDatagrams
from .keeper import StateKeeper
from .membership import Membership
from .metrics import LedgerCollector
from .preserialized import PassingBytes
from .recovery import Recovery
from .runs import Runs
from .service import CoordinatorService
from .serving import serving_options
from .settings import CoordinatorSettings
from .stage_board import StageBoard
from .status.http import StatusApp
from .store import Store


class ServeError(MurmurError):
    pass


@dataclass(kw_only=True, slots=True)
class ServeOptions:
    db: Path
    listen: str = "127.0.0.1:7700"
    node_listen: str = ""  # default: the listen host, port + 1 (port 0 stays 0)
    metrics_listen: str = ""  # default: the listen host, port + 2; "off" disables it
    advertise_host: str = ""  # the host nodes should dial; default: the listen host (127.0.0.1 for 0.0.0.0)
    dht: bool = False
    dht_listen: str = ""  # where the DHT (libp2p) listens (default: the --listen host, port 0)
    settings: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    log_format: str = "text"  # the stderr lines: "text" (stamped) or "json" (murmur/logline.py)


def split_address(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ServeError(f"{what} {address!r} must look like HOST:PORT (PORT 0 picks a free one)")
    return host, int(port)


def _derived(listen: str, given: str, offset: int, what: str) -> str:
    if given:
        split_address(given, what)
        return given
    host, port = split_address(listen, "--listen")
    return f"{host}:{port + offset if port else 0}"


def _dht_default(listen: str) -> str:
    """The DHT beside the public address: its host when that is an IPv4 address (libp2p listens on
    addresses, not names), else every interface; port 0 takes the port saved beside the ledger,
    else a free one (discovery.py)."""
    host = split_address(listen, "--listen")[0]
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        host = "0.0.0.0"  # a name or IPv6 --listen: the DHT listens wherever the name may lead
    return f"{host}:0"


class Coordinator:
    def __init__(self, options: ServeOptions, clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self.settings = options.settings
        self.log = line_writer(options.log_format, sys.stderr)  # stamped lines, as a node's are
        self.store = Store(options.db, wal_checkpoint_pages=self.settings.wal_checkpoint_pages)
        problems = self.store.check_consistency()
        for problem in problems:  # never expected; shown loudly rather than refusing to start
            self.log(f"warning: ledger inconsistency: {problem}")
        self.clock = clock
        with self.store.write():
            self.store.event(
                "coordinator_started",
                schema=self.store.schema_version(),
                migrated_from=self.store.migrated_from,
            )
        host = split_address(options.listen, "--listen")[0]
        self.secrets = authority.load_or_create(options.db, [h for h in {host, options.advertise_host} if h])
        self.membership = Membership(self.store, self.settings, self.secrets.ca, clock=clock)
        self.runs = Runs(self.store, self.settings, self.secrets.ca_fingerprint, clock=clock)
        # Stage leases of pipelined runs; moves wait until the view of live peers is whole.
        self.stages = StageBoard(self.store, self.membership.is_live, self.membership.view_is_whole, clock=clock)
        self.service = CoordinatorService(
            self.store,
            self.settings,
            self.membership,
            self.runs,
            self.secrets.admin_key,
            self.secrets.ca.cert_pem,
            self.stages,
        )
        # The run's newest verified state, kept beside the ledger (coordinator/keeper.py), and the
        # operator's say when no copy of it exists anywhere (coordinator/recovery.py).
        self.keeper = StateKeeper(options.db, self.store, self.membership, self.stages, self.log, clock=clock)
        self.service.keeper = self.keeper
        self.service.recovery = Recovery(self.store, self.keeper.kept_round)
        collector = LedgerCollector(
            self.store, self.service.stats, self.membership.pending_count, self.membership.tokens_per_s,
            self.service.status.progress, lambda: self.service.datagrams, self.service.group,
        )
        self.metrics = StatusApp(self.service.status, self.membership, collector, self.secrets.admin_key).server()
        self.server: grpc.aio.Server | None = None
        self.dht: Discovery | None = None
        self._stop = asyncio.Event()

    async def start(self) -> dict[str, object]:
        opts, s = self.options, self.settings
        # The DHT first: hivemind forks its process, and a fork under live gRPC threads can abort
        # the child (abseil's mutex check); nothing of gRPC exists yet here.
        if opts.dht:
            await self._start_dht()
        node_listen = _derived(opts.listen, opts.node_listen, 1, "--node-listen")
        if s.heartbeat_fronts:  # processes of their own: started before gRPC's threads are (as the DHT)
            key_file, cert_file, _ = authority.paths(opts.db)
            fronts = HeartbeatFronts(s.heartbeat_fronts, self.service.front_beat, key_file, cert_file, s, self.log)
            self.service.fronts = fronts
            await fronts.start(split_address(node_listen, "--node-listen")[0])
        self.server = grpc.aio.server(options=[*tls.server_options(s.max_message_bytes), *serving_options(s)])
        # A request that does not parse is refused in one line (INVALID_ARGUMENT), on every method;
        # a heartbeat reply may be bytes assembled already (a whole view: coordinator/preserialized.py).
        malformed.register(pb_grpc.add_CoordinatorServicer_to_server, self.service, PassingBytes(self.server))
        kept_server.register(self.server, self.keeper, self.membership)  # GetState of kept states
        pair = [(self.secrets.tls_key_pem, self.secrets.ca.cert_pem)]
        public_creds = grpc.ssl_server_credentials(pair)
        node_creds = grpc.ssl_server_credentials(
            pair, root_certificates=self.secrets.ca.cert_pem, require_client_auth=True
        )
        host, _ = split_address(opts.listen, "--listen")
        try:
            port = self.server.add_secure_port(opts.listen, public_creds)
            node_port = self.server.add_secure_port(node_listen, node_creds)
        except RuntimeError as err:
            raise ServeError(f"cannot listen on {opts.listen} / {node_listen}: {err}; is the port taken?") from None
        # The restart grace starts now, when nodes can reach us again, not when the process began
        # (starting the DHT alone can take seconds).
        now = self.clock()
        with self.store.write():
            self.store.push_deadlines(now, s.restart_grace_s)
        self.membership.hold(now + s.restart_grace_s)
        self.membership.view_from(now + s.heartbeat_ttl_s)  # until then, replies list no trainers
        advertise = opts.advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "[::]", "::") else host)
        await self._start_datagrams(node_listen, advertise)  # before any Join reply: each offers it
        await self.server.start()
        self.service.node_address = f"{advertise}:{node_port}"
        if self.service.fronts is not None:
            self.service.fronts.advertise = advertise
        self.keeper.node_address = self.service.node_address
        self.service.started_at = self.clock()
        metrics_address = ""
        if opts.metrics_listen != "off":
            mhost, mport = split_address(
                _derived(opts.listen, opts.metrics_listen, 2, "--metrics-listen"), "--metrics-listen"
            )
            try:
                mport = await self.metrics.start(mhost, mport)
            except OSError as err:
                raise ServeError(f"cannot serve metrics on {mhost}:{mport}: {err}") from None
            metrics_address = f"{mhost}:{mport}"
        if self.dht is not None:
            self.service.bootstrap_peers = self.dht.announce_from(f"{advertise}:{port}")
        return {
            "event": "listening",
            "address": f"{advertise}:{port}",
            "node_address": self.service.node_address,
            "metrics": metrics_address,
            "ca_fingerprint": self.secrets.ca_fingerprint,
            "ca_cert_file": str(self.secrets.ca_cert_path),
            "admin_key_file": str(self.secrets.admin_key_path),
            "dht": self.service.bootstrap_peers,
            "heartbeat_fronts": self.service.fronts.addresses() if self.service.fronts is not None else [],
            "heartbeat_udp": self.service.datagrams.address if self.service.datagrams is not None else "",
            "schema_version": self.store.schema_version(),
            "migrated_from": self.store.migrated_from,
        }

    async def _start_datagrams(self, node_listen: str, advertise: str) -> None:
        """Heartbeat datagrams on the node address's host (coordinator/heartbeat_udp.py), unless off."""
        node_host, node_port = split_address(node_listen, "--node-listen")
        port = self.settings.heartbeat_udp_port(node_port)
        if port is None:
            return
        datagrams = HeartbeatDatagrams(self.service.datagram_beat)
        try:
            try:
                await datagrams.start(node_host.strip("[]"), port, advertise)
            except OSError as err:
                if self.settings.heartbeat_udp != "node-port" or not port:
                    raise
                # The node port's number is taken for UDP by another program (a restart on a fixed
                # node port can find it so): a free one, which the nodes are told; one line says so.
                await datagrams.start(node_host.strip("[]"), 0, advertise)
                self.log(f"warning: UDP port {port} is taken ({err.strerror}); heartbeat datagrams on "
                         f"{datagrams.address} instead (nodes are told; --heartbeat-udp PORT fixes one)")
        except OSError as err:
            raise ServeError(
                f"cannot receive heartbeat datagrams on UDP {node_host}:{port}: {err}; pass --heartbeat-udp PORT "
                "(0 picks a free one) or --heartbeat-udp off"
            ) from None
        self.service.datagrams = datagrams

    async def _start_dht(self) -> None:
        host, port = split_address(self.options.dht_listen or _dht_default(self.options.listen), "--dht-listen")
        self.dht = Discovery(
            self.secrets.ca,
            self.options.db,
            self.settings,
            host,
            port,
            lambda: [r["run_id"] for r in self.store.runs() if r["state"] == "active"],
            log=self.log,
        )
        try:
            await self.dht.start()
        except MurmurError as err:
            raise ServeError(f"{err}; --no-dht runs with no discovery (nodes then need --dht-peer)") from None

    async def sweeper(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.sweep_interval_s)
            try:
                self.membership.sweep()
                self.stages.tick()
            except Exception as err:  # noqa: BLE001 - a failed sweep must not kill the coordinator
                self.log(f"warning: sweep failed: {err!r}")

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self, ready: Callable[[dict[str, object]], None]) -> None:
        info = await self.start()
        # Everything built so far lives as long as the process: move it out of the collector's sight,
        # so full collections (which stop the loop) stay short as the heap grows with connections.
        gc.collect()
        gc.freeze()
        ready(info)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        sweeper = asyncio.create_task(self.sweeper())
        keeper = asyncio.create_task(self.keeper.run(self._stop))
        try:
            await self._stop.wait()
        finally:
            await self.close(sweeper)
            with contextlib.suppress(asyncio.CancelledError):
                keeper.cancel()
                await keeper

    async def close(self, sweeper: asyncio.Task[None] | None = None) -> None:
        self._stop.set()
        if self.server is not None:
            await self.service.end_streams()  # each node's heartbeat stream would hold the grace period
            await self.server.stop(self.settings.grpc_grace_s)
        if self.service.fronts is not None:  # each ends its streams with UNAVAILABLE, as above
            await self.service.fronts.stop()
        if self.service.datagrams is not None:
            self.service.datagrams.close()
        if sweeper is not None:
            await sweeper
        await self.keeper.aclose()  # a pull at a lease's end writes to the ledger: done before it closes
        await self.metrics.stop()
        if self.dht is not None:
            with contextlib.suppress(Exception):
                await self.dht.stop()
        self.membership.flush()
        with self.store.write():
            self.store.event("coordinator_stopped")
        self.store.close()


def run(options: ServeOptions) -> int:
    async def main() -> None:
        coordinator = Coordinator(options)

        def ready(info: dict[str, object]) -> None:
            # The human summary first: whoever waits for the JSON line finds it written already.
            coordinator.log(
                f"murmur coordinator: serving {info['address']} (nodes: {info['node_address']}, heartbeat datagrams: "
                f"{'udp://' + str(info['heartbeat_udp']) if info['heartbeat_udp'] else 'off'}, status page and "
                f"metrics: {'http://' + str(info['metrics']) + '/' if info['metrics'] else 'off'})\n"
                f"  CA fingerprint {info['ca_fingerprint']}\n"
                f"  admin credential {info['admin_key_file']}"
            )
            print(json.dumps(info), flush=True)

        await coordinator.serve(ready)

    asyncio.run(main())
    return 0
