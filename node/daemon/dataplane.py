"""The node's data plane: its peer server, the DHT, the update exchange and state transfer.

The daemon (node_lifecycle.py) sees one small object:

    exchange                  the run's `Exchange` (all_reduce / all_gather returning futures)
    publish(round, state)     offer the global state of a round to joiners and laggards
    await fetch_state(min_round=, timeout_s=)   the newest state of round >= min_round from peers
                              (verified against its hash), or None when no peer is ahead
    last_round_members()      who took part in the last completed exchange
    await close()             stop serving, leave the DHT, no child process left

`open_dataplane` builds it from node/daemon/peer_dataplane.py (peer server, gRPC exchange, DHT). ``solo`` is a
one-member group: a node that trains alone against a coordinator (trying a run, or its ledger) with
the same sync code and no peers.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import JoinInfo
from murmur.optim.exchange import Exchange
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.optim.inprocess import InProcessGroup
from murmur.protocol import identity
from murmur.protocol.runconfig import RunConfig


class _MemberTracker(Exchange):
    """Wraps an exchange to remember who made it into the last completed round (for the progress line)."""

    def __init__(self, inner: Exchange) -> None:
        self.inner = inner
        self.members: list[str] = []

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def _track(self, fut: Future) -> Future:
        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                result = f.result()
                self.members = list(getattr(result, "members", None) or getattr(result, "updates", {}) or [])

        fut.add_done_callback(done)
        return fut

    def all_reduce(self, tensors, *, round_id: int, key: str = "", weight: float = 1.0):  # noqa: ANN001
        return self._track(self.inner.all_reduce(tensors, round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire, *, round_id: int, key: str = ""):  # noqa: ANN001
        return self._track(self.inner.all_gather(wire, round_id=round_id, key=key))

    def close(self) -> None:
        self.inner.close()


class SoloDataPlane:
    """A one-member group: every round completes at once with this node's own update."""

    def __init__(self, node_id: str, cfg: RunConfig) -> None:
        group = InProcessGroup([node_id], lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))
        self.exchange = _MemberTracker(group.exchange(node_id))

    def publish(self, round_id: int, tensors: list[tuple[str, Any]]) -> None:
        pass

    async def fetch_state(self, *, min_round: int, timeout_s: float) -> dict[str, Any] | None:
        return None

    async def wait_for_peers(
        self, count: int, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> int:
        return 1

    def last_round_members(self) -> list[str]:
        return self.exchange.members

    async def close(self) -> None:
        self.exchange.close()


async def open_dataplane(
    *,
    ident: identity.Identity,
    info: JoinInfo,
    cfg: RunConfig,
    settings: NodeSettings,
    listen: str,
    advertise_host: str,
    log: Callable[[str], None],
    solo: bool = False,
    dht_peers: list[str] | None = None,
    state_dir: Path | None = None,
) -> Any:
    if solo:
        log("solo mode: a one-member exchange, no peer server, no DHT")
        return SoloDataPlane(info.node_id, cfg)
    from murmur.node.daemon import peer_dataplane  # noqa: PLC0415 - imports hivemind and the gRPC peer stack

    return await peer_dataplane.open_peer_dataplane(
        ident=ident,
        info=info,
        cfg=cfg,
        settings=settings,
        listen=listen,
        advertise_host=advertise_host,
        log=log,
        dht_peers=list(dht_peers or []),
        state_dir=state_dir or Path("."),
    )
