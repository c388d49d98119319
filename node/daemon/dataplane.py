"""What the daemon needs of its data plane (the peers' side of training), and the solo plane.

Two planes provide it: `SoloDataPlane` here, a one-member group for a node that trains alone
against a coordinator (trying a run, or its ledger) with the same sync code and no peers; and
`PeerDataPlane` (node/daemon/peer_dataplane.py: the peer server, the DHT, the gRPC exchange and
state transfer). The daemon (node/daemon/node.py) picks one and sees only `DataPlane`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from murmur.optim.exchange import Exchange, GatherResult, ReduceResult
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.optim.inprocess import InProcessGroup
from murmur.optim.wire import WireTensor
from murmur.protocol.runconfig import RunConfig


class DataPlane(Protocol):
    @property
    def exchange(self) -> Exchange:
        """The run's exchange (all_reduce / all_gather returning futures), for the training thread."""
        ...

    def publish(self, round_id: int, tensors: list[tuple[str, torch.Tensor]], digest: bytes | None = None) -> None:
        """Offer the global state of a round to joiners and laggards (``digest``: its
        `tensors_hash`, when the caller computed it already)."""
        ...

    async def fetch_state(
        self, *, min_round: int, timeout_s: float, exclude: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor] | None:
        """The newest state of a round >= ``min_round`` from peers not in ``exclude`` (verified
        against its hash), or None when no such peer is ahead."""
        ...

    async def wait_for_peers(self, count: int, timeout_s: float, stop: Callable[[], bool]) -> int:
        """Wait until ``count`` peers (this one included) are seen, the timeout, or ``stop()``;
        returns how many were seen."""
        ...

    def take_rejections(self) -> list[tuple[int, str, str]]:
        """(round, sender, reason) of the inputs this node refused as an owner since the last call."""
        ...

    def last_round_members(self) -> list[str]:
        """Who took part in the last completed exchange."""
        ...

    rate: float  # this node's compute speed (inner steps/s, optim/budget.py), announced to its peers

    def member_rates(self) -> dict[str, float]:
        """The last round's members' compute speeds as last announced (0: unknown), for
        sync.round_budget = "speed" (optim/budget.py)."""
        ...

    async def close(self) -> None:
        """Stop serving and leave, with no child process left."""
        ...


class MemberTracker(Exchange):
    """Wraps an exchange to remember who made it into the last completed round (for the progress line)."""

    def __init__(self, inner: Exchange) -> None:
        self.inner = inner
        self.members: list[str] = []

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def _track(self, fut: Future[Any]) -> Future[Any]:
        def done(f: Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                result = f.result()
                self.members = list(getattr(result, "members", None) or getattr(result, "updates", {}) or [])

        fut.add_done_callback(done)
        return fut

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> Future[ReduceResult]:
        return self._track(self.inner.all_reduce(tensors, round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire: Sequence[WireTensor], *, round_id: int, key: str = "") -> Future[GatherResult]:
        return self._track(self.inner.all_gather(wire, round_id=round_id, key=key))

    def close(self) -> None:
        self.inner.close()


class SoloDataPlane:
    """A one-member group: every round completes at once with this node's own update."""

    def __init__(self, node_id: str, cfg: RunConfig) -> None:
        group = InProcessGroup([node_id], lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))
        self.exchange = MemberTracker(group.exchange(node_id))
        self.rate = 0.0

    def publish(self, round_id: int, tensors: list[tuple[str, torch.Tensor]], digest: bytes | None = None) -> None:
        """No one to offer it to."""

    async def fetch_state(
        self, *, min_round: int, timeout_s: float, exclude: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor] | None:
        return None

    async def wait_for_peers(self, count: int, timeout_s: float, stop: Callable[[], bool]) -> int:
        return 1

    def take_rejections(self) -> list[tuple[int, str, str]]:
        return []  # a one-member exchange refuses nobody

    def last_round_members(self) -> list[str]:
        return self.exchange.members

    def member_rates(self) -> dict[str, float]:
        return {}  # alone: the round's budget is H

    async def close(self) -> None:
        self.exchange.close()
