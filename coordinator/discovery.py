"""The coordinator on the discovery plane: a DHT bootstrap peer that announces its own address.

Nodes get the coordinator's DHT multiaddrs in the join reply (``bootstrap_peers``) and find the
coordinator's address in the DHT under each active run's peers key (role "coordinator"), so a node
that restarts can find it again even if it only remembers a peer. Records must be signed by a
certificate of the run CA (protocol/dht.py); the coordinator issues itself one at start.

hivemind is imported only through protocol/dht.py, and only when ``--dht`` is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable

from murmur.protocol import identity

from .settings import CoordinatorSettings


class Discovery:
    def __init__(
        self,
        ca: identity.CertificateAuthority,
        address: str,
        settings: CoordinatorSettings,
        host: str,
        port: int,
        active_runs: Callable[[], list[str]],
    ) -> None:
        from murmur.protocol import dht as dht_adapter  # hivemind only when asked for

        self._dht_mod = dht_adapter
        self.address = address
        self.settings = settings
        self.active_runs = active_runs
        self.identity = ca.issue()  # a fresh key per start: records carry its certificate
        self.handle = dht_adapter.MurmurDHT(
            "coordinator",
            ca_cert_pem=ca.cert_pem,
            identity=self.identity,
            settings=dht_adapter.DHTSettings(host=host, port=port, start_timeout=settings.dht_start_timeout_s),
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> list[str]:
        await asyncio.to_thread(self.handle.start)
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
                print(f"warning: DHT announcement failed: {err}", file=sys.stderr)
            await asyncio.sleep(period)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.handle.shutdown)
