"""Who takes part in a round: the group providers the gRPC exchange asks before each call.

``StaticGroup`` is a fixed {node id: address} map (tests, benchmarks, a fixed cluster).
``DHTGroup`` meets the other peers through the DHT rendezvous of protocol/dht.py: each peer
puts itself under the round's key and reads it back until ``expected`` peers are there or the
rendezvous deadline passes. Peers that saw different member lists converge inside the exchange
(an attempt's owners answer with their lists; see node/exchange/grpc_exchange.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


class GroupProvider(Protocol):
    async def members(self, round_id: int, key: str) -> dict[str, str]: ...


class StaticGroup:
    def __init__(self, peers: Mapping[str, str]) -> None:
        self.peers = dict(peers)

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        return dict(sorted(self.peers.items()))


@dataclass(kw_only=True, slots=True)
class RendezvousSettings:
    deadline: float = 30.0  # seconds a peer waits at the rendezvous for the others
    min_members: int = 1  # fewer by the deadline: the round fails


class DHTGroup:
    """Round membership from the DHT (``dht`` is a started protocol.dht.MurmurDHT)."""

    def __init__(
        self,
        dht,
        address: str,
        *,
        expected: int | Callable[[], int | None] | None = None,
        settings: RendezvousSettings | None = None,
    ) -> None:
        self.dht = dht
        self.address = address
        self.expected = expected
        self.settings = settings or RendezvousSettings()

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        return await self.dht.arendezvous(
            round_id,
            key,
            self.address,
            deadline=time.monotonic() + self.settings.deadline,
            expected=self.expected,
            min_members=self.settings.min_members,
        )
