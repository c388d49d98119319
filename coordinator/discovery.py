"""The coordinator on the discovery plane: a DHT bootstrap peer that announces its own address.

Nodes get the coordinator's DHT multiaddrs in the join reply (``bootstrap_peers``) and find the
coordinator's address in the DHT under each active run's peers key (role "coordinator"), so a node
that restarts can find it again even if it only remembers a peer. Records must be signed by a
certificate of the run CA (protocol/dht.py); the coordinator issues itself one at start.

A restart is invisible to nodes: the libp2p key lives next to the ledger (``DB.dht-key``, so the
peer id stays the same) and so does the port the DHT got (``DB.dht-port``, reused when
``--dht-listen`` asks for port 0), so the bootstrap addresses nodes saved still lead here.

hivemind is imported only through protocol/dht.py, and only when ``--dht`` is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from murmur.protocol import identity

from .settings import CoordinatorSettings


def state_paths(db_path: Path) -> tuple[Path, Path]:
    """Where the DHT's key and port are kept, next to the ledger."""
    return db_path.with_name(db_path.name + ".dht-key"), db_path.with_name(db_path.name + ".dht-port")


def _saved_port(path: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        port = int(path.read_text().strip())
        if 0 < port < 65536:
            return port
    return 0


class Discovery:
    def __init__(
        self,
        ca: identity.CertificateAuthority,
        db_path: Path,
        settings: CoordinatorSettings,
        host: str,
        port: int,
        active_runs: Callable[[], list[str]],
        log: Callable[[str], None] | None = None,
    ) -> None:
        from murmur.protocol import dht as dht_adapter  # hivemind only when asked for

        self._dht_mod = dht_adapter
        self.address = ""  # our public gRPC address; known once the gRPC server is bound
        self.settings = settings
        self.active_runs = active_runs
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.identity = ca.issue()  # a fresh signing key per start: records carry its certificate
        self._key_path, self._port_path = state_paths(db_path)
        self._asked_port = port
        self._settings = dht_adapter.DHTSettings(
            host=host,
            port=port or _saved_port(self._port_path),
            start_timeout=settings.dht_start_timeout_s,
            identity_path=str(self._key_path),
        )
        self.handle = self._handle(self._settings)
        self._task: asyncio.Task[None] | None = None

    def _handle(self, settings):  # -> dht_adapter.MurmurDHT
        return self._dht_mod.MurmurDHT(
            "coordinator", ca_cert_pem=self.identity.ca_cert_pem, identity=self.identity, settings=settings
        )

    async def start(self) -> list[str]:
        try:
            await asyncio.to_thread(self.handle.start)
        except self._dht_mod.DHTError as err:
            if self._asked_port or not self._settings.port:
                raise
            # The saved port is taken by something else now: take any port (nodes will re-read the
            # bootstrap addresses from the join reply or the coordinator).
            self.log(f"warning: the DHT's previous port {self._settings.port} is not free ({err}); taking another")
            self._settings.port = 0
            self.handle = self._handle(self._settings)
            await asyncio.to_thread(self.handle.start)
        port = self._dht_mod.port_of(self.handle.addresses)
        if port:
            self._port_path.write_text(f"{port}\n")
        return self.handle.addresses

    def announce_from(self, address: str) -> list[str]:
        """Start announcing ``address`` (our gRPC address) under every active run; the bootstrap
        addresses for the join reply."""
        self.address = address
        self._task = asyncio.create_task(self._announce_loop())
        return self.handle.addresses

    def announce_once(self) -> int:
        """Announce under every active run's key (the adapter keys records by its run id)."""
        runs = self.active_runs()
        for run_id in runs:
            self.handle.run_id = run_id
            self.handle.announce(
                self._dht_mod.PeerRecord(node_id=self.identity.node_id, address=self.address, role="coordinator")
            )
        return len(runs)

    async def _announce_loop(self) -> None:
        # Re-announce well before the record's TTL runs out (a third of it).
        period = self.handle.settings.record_ttl / 3
        while True:
            try:
                await asyncio.to_thread(self.announce_once)
            except Exception as err:  # noqa: BLE001 - discovery trouble must not stop the coordinator
                self.log(f"warning: DHT announcement failed: {err}")
            await asyncio.sleep(period)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.handle.shutdown)
