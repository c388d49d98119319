"""`InProcessExchange`: the simulator's exchange, K peers of one process meeting in memory.

Each peer gets its own handle (and its own codec, so error feedback stays per peer). A call
files the peer's payload under (kind, round_id, key); the call that completes the group
computes the result once, in sorted peer order, and resolves every member's future with its
own copy. Peers may be threads (the simulator runs one per worker) or one thread driving
several handles, as long as no one waits before everyone has submitted.

`abort()` fails every pending and later call, so one crashed worker cannot leave the others
waiting for ever; callers still bound every wait with their round timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult, SharedMemo
from murmur.optim.reduce import allreduce_bytes, gather_bytes, reduce_payloads, wire_bytes
from murmur.optim.wire import WireTensor


@dataclass(slots=True)
class _Slot:
    payloads: dict[str, list[WireTensor]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)
    codec: Codec | None = None


class InProcessGroup:
    def __init__(
        self, peers: Sequence[str], codec_factory: Callable[[], Codec], aggregator: Aggregator | None = None
    ) -> None:
        if len(set(peers)) != len(peers) or not peers:
            raise ValueError("peers must be distinct and non-empty")
        self.peers = sorted(peers)
        self.aggregator = aggregator or Aggregator()
        self._codec_factory = codec_factory
        self._slots: dict[tuple[str, int, str], _Slot] = {}
        self._lock = threading.Lock()
        self._aborted: str | None = None
        self._handles = {p: InProcessExchange(self, p, codec_factory()) for p in self.peers}

    def exchange(self, peer: str) -> InProcessExchange:
        return self._handles[peer]

    def abort(self, reason: str) -> None:
        with self._lock:
            self._aborted = reason
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            for fut in slot.futures.values():
                if not fut.done():
                    fut.set_exception(ExchangeError(f"round aborted: {reason}"))

    def _submit(
        self,
        kind: str,
        peer: str,
        round_id: int,
        key: str,
        wires: list[WireTensor],
        weight: float,
        codec: Codec,
    ) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._aborted is not None:
                fut.set_exception(ExchangeError(f"group aborted: {self._aborted}"))
                return fut
            slot = self._slots.setdefault((kind, round_id, key), _Slot(codec=codec))
            if peer in slot.payloads:
                fut.set_exception(ExchangeError(f"{peer} submitted round {round_id} {key!r} twice"))
                return fut
            slot.payloads[peer], slot.weights[peer], slot.futures[peer] = wires, weight, fut
            complete = len(slot.payloads) == len(self.peers)
            if complete:
                del self._slots[(kind, round_id, key)]
        if complete:  # compute outside the lock: other rounds may proceed meanwhile
            try:
                self._finish(kind, key, slot)
            except Exception as err:  # noqa: BLE001 - every member must hear of the failure
                for f in slot.futures.values():
                    if not f.done():
                        f.set_exception(ExchangeError(f"round {round_id} {key!r} failed: {err}"))
        return fut

    def _finish(self, kind: str, key: str, slot: _Slot) -> None:
        k = len(self.peers)
        # Decode and re-encode with the first peer's codec, whoever arrived first: reproducible.
        slot.codec = self._handles[self.peers[0]].codec
        if kind == "gather":
            codec_name = next((w[0].codec for w in slot.payloads.values() if w), slot.codec.name)
            memo = SharedMemo()  # the same updates for every member: decode them once
            for p in self.peers:
                own = wire_bytes(slot.payloads[p])
                received = sum(wire_bytes(slot.payloads[q]) for q in self.peers if q != p)
                updates = {q: slot.payloads[q] for q in self.peers}
                slot.futures[p].set_result(
                    GatherResult(updates, {}, gather_bytes(k, own), received, codec_name, memo)
                )
            return
        tensors, members, dropped, back = reduce_payloads(
            slot.codec, self.aggregator, slot.payloads, slot.weights, key
        )
        result_bytes = wire_bytes(back)
        for p in self.peers:
            own = wire_bytes(slot.payloads[p])
            sent = allreduce_bytes(slot.codec.dense, k, own, result_bytes)
            received = (
                sent
                if slot.codec.dense
                else sum(wire_bytes(slot.payloads[q]) for q in self.peers if q != p)
            )
            copies = [t.clone() for t in tensors]  # each member owns its result (it may edit it in place)
            slot.futures[p].set_result(
                ReduceResult(copies, list(members), dict(dropped), sent, received, slot.codec.name)
            )


class InProcessExchange(Exchange):
    def __init__(self, group: InProcessGroup, peer: str, codec: Codec) -> None:
        self._group, self._peer, self.codec = group, peer, codec

    @property
    def peer_id(self) -> str:
        return self._peer

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> Future[ReduceResult]:
        wires = [self.codec.encode(t, f"{key}/{i}") for i, t in enumerate(tensors)]
        return self._group._submit("reduce", self._peer, round_id, key, wires, weight, self.codec)

    def all_gather(self, wire: Sequence[WireTensor], *, round_id: int, key: str = "") -> Future[GatherResult]:
        return self._group._submit("gather", self._peer, round_id, key, list(wire), 1.0, self.codec)
