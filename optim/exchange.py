"""The `Exchange` interface: collective operations on wire tensors among a group of peers.

Transport-agnostic. `InProcessExchange` (the simulator) and the gRPC exchange of the node are
drop-in implementations of the same class. Calls come from the training thread; each returns a
`concurrent.futures.Future` so that training can go on while an exchange is in flight (Streaming
DiLoCo's overlap). Every member of the group makes the same call for the same ``round_id`` and
``key``; the result is the same on every member.

Changes since the first cut (additive): `ReduceResult` and `GatherResult` carry ``codec``, the
name of the codec the payload travelled in, so byte counters can be kept per codec. The rules
both implementations share (decode, pre-filter, aggregate, re-encode, how many bytes a peer
sends) live in `murmur.optim.reduce`, so the gRPC exchange only has to move the payloads.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from murmur.optim.wire import WireTensor


@dataclass(slots=True)
class ReduceResult:
    tensors: list[torch.Tensor]             # the aggregated, decoded tensors, in input order
    members: list[str]                       # peers whose input made it into the result
    dropped: dict[str, str] = field(default_factory=dict)  # peer -> reason it was left out
    bytes_sent: int = 0                      # payload bytes this peer put on the wire for the call
    bytes_received: int = 0
    codec: str = ""


class SharedMemo:
    """Values derived from a gather's updates, computed once for every member that received the
    same updates. Over the wire each peer has its own; in one process (the simulator) the K
    members share one, so K replicas do not decode the same payloads K times."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, object] = {}
        self.computed = 0  # values computed (one per key, however many members asked)

    def get(self, key: str, compute: Callable[[], object]) -> object:
        with self._lock:  # the other members wait for the first one's result instead of redoing it
            if key not in self._values:
                self._values[key] = compute()
                self.computed += 1
            return self._values[key]


@dataclass(slots=True)
class GatherResult:
    updates: dict[str, list[WireTensor]]     # peer -> that peer's wire tensors, every member
    dropped: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    codec: str = ""
    memo: SharedMemo = field(default_factory=SharedMemo)  # read-only derived values (see SharedMemo)


class ExchangeError(RuntimeError):
    """A round that could not complete; the caller must not apply a partial result."""


class Exchange(abc.ABC):
    """One peer's handle on its group."""

    @property
    @abc.abstractmethod
    def peer_id(self) -> str: ...

    @abc.abstractmethod
    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        round_id: int,
        key: str = "",
        weight: float = 1.0,
    ) -> Future[ReduceResult]:
        """Weighted mean (or the configured robust aggregate) of every member's ``tensors``.

        The implementation compresses with the run's codec and aggregates with the run's rule.
        ``weight`` 0 lets a late joiner take part without moving the result. It may read
        ``tensors`` until the future completes (the gRPC exchange copies them chunk by chunk while
        the first chunks are already on the wire): pass tensors nobody changes meanwhile, as
        DiLoCo's fresh pseudo-gradients are.
        """

    @abc.abstractmethod
    def all_gather(self, wire: Sequence[WireTensor], *, round_id: int, key: str = "") -> Future[GatherResult]:
        """Every member's wire tensors (sparse updates whose index sets differ, e.g. DeMo)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most implementations need nothing
        """Release sockets and threads."""
