"""What one call of the exchange carries across its attempts, and what an owner answers.

A call is one collective of one round (round_id, key): a `ReduceCall` (a dense all-reduce: the
flat update, cut into one span per member and each span into pipeline chunks) or a `GatherCall`
(one whole payload to every member). `AttemptProgress` is what the streams of one attempt share:
when data last moved, and which owners our whole input reached. A `Reply` is an owner's answer to
one stream, or ERROR when none came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import grpc
import torch

from murmur.node.exchange.groups import column_block
from murmur.node.exchange.settings import chunk_ranges, spans
from murmur.node.exchange.snapshot import Snapshot
from murmur.node.net.faults import CallFaults
from murmur.optim.codecs import Codec
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2
from murmur.protocol.reachability import is_client
from murmur.protocol.version import PROTOCOL_VERSION

ERROR = -1  # a call that produced no status at all (unreachable, refused at the door, stalled)


@dataclass(slots=True)
class Reply:
    code: int
    reason: str = ""
    failed: dict[str, str] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    attempt: int = 0
    result_hash: bytes = b""


def reply_of(st: peer_pb2.ExchangeStatus) -> Reply:
    """An owner's status as a Reply (ERROR if it speaks another protocol version)."""
    if st.protocol_version != PROTOCOL_VERSION:
        why = f"answers in protocol v{st.protocol_version}, this node speaks v{PROTOCOL_VERSION}"
        return Reply(ERROR, reason=why)
    return Reply(st.code, st.reason, dict(st.failed), list(st.members), st.attempt, st.result_hash)


@dataclass(kw_only=True, slots=True)
class Call:
    """What every call needs across its attempts."""

    op: ClassVar[int]  # peer_pb2.OP_REDUCE or OP_GATHER
    round_id: int
    key: str
    weight: float
    layout: bytes  # the hash both sides of a stream must agree on (codec, shapes, chunking)
    peers: dict[str, str]  # node id -> address, this peer included; a restarted peer's new address wins
    start_members: int  # the quorum is a fraction of these
    deadline: float  # loop time by which the call ends, one way or the other
    codec: Codec  # the exchange's codec when the call started
    faults: CallFaults  # the injected faults that strike this call
    sent: int = 0
    received: int = 0
    dropped: dict[str, str] = field(default_factory=dict)

    def owners(self, members: Sequence[str]) -> tuple[str, ...]:
        """The members that own a part of the result: those that can be dialed. Every member
        derives the same list, since all read the same addresses from the rendezvous."""
        return tuple(m for m in members if not is_client(self.peers.get(m, "")))


@dataclass(kw_only=True, slots=True)
class ReduceCall(Call):
    op: ClassVar[int] = peer_pb2.OP_REDUCE
    x: torch.Tensor  # the flat update (error feedback added), copied by ``snapshot``
    snapshot: Snapshot  # copies ``x`` piece by piece: ask it before reading a range of x
    result: torch.Tensor  # the flat result, filled chunk by chunk
    own: torch.Tensor | None  # with error feedback: what our encoded input decodes to
    align: int  # span and chunk boundaries fall on multiples of this
    chunk: int  # elements per pipeline chunk
    # A reduce-scatter (node/exchange/hierarchy.py's phase A): the update is cut into this many
    # columns, each owner reduces a contiguous block of them (``column_block``) and keeps it: no
    # result goes back to the members, and a member's result is its own span only. 0: an
    # all-reduce, one span per owner, every span back to every member.
    columns: int = 0

    @property
    def numel(self) -> int:
        return self.x.numel()

    @property
    def owned(self) -> bool:
        """A reduce-scatter: each owner keeps its span."""
        return self.columns > 0

    def span_of(self, owners: Sequence[str], owner: str) -> tuple[int, int]:
        """[start, end) of the flat update that ``owner`` reduces among ``owners``."""
        i = list(owners).index(owner)
        if not self.columns:
            return spans(self.numel, len(owners), self.align)[i]
        cols = spans(self.numel, self.columns, self.align)
        lo, hi = column_block(i, len(owners), self.columns)
        return (cols[lo][0], cols[hi - 1][1]) if hi > lo else (cols[lo - 1][1],) * 2 if lo else (0, 0)

    def ranges(self, span: tuple[int, int]) -> list[tuple[int, int]]:
        """The pipeline chunks of ``span``, relative to its start."""
        return chunk_ranges(span[1] - span[0], self.chunk)


@dataclass(kw_only=True, slots=True)
class GatherCall(Call):
    op: ClassVar[int] = peer_pb2.OP_GATHER
    wires: list[WireTensor]  # our input, as this peer's own attempt input holds it
    payload: bytes  # our input serialized once (faults applied), the same for every owner
    # The layout every member's input fits (None: ours). With it, a tensor may be empty instead
    # (node/exchange/validate.py's ``ragged``): members send different numbers of used slots.
    template: list[WireTensor] | None = None

    @property
    def expected(self) -> list[WireTensor]:
        """What every member's input is checked against."""
        return self.template if self.template is not None else self.wires


class AttemptProgress:
    """Shared by the streams of one attempt: when data last moved, which owners have our input."""

    def __init__(self, others: int) -> None:
        self.others = others
        self.last = asyncio.get_running_loop().time()
        self.delivered: set[str] = set()  # owners our whole input reached, this attempt

    def moved(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def deliver(self, owner: str) -> bool:
        """Record that ``owner`` has our whole input; True once every other member has it."""
        self.delivered.add(owner)
        return len(self.delivered) == self.others


def grpc_reason(err: grpc.aio.AioRpcError) -> str:
    return f"{err.code().name}: {err.details()}"


CONNECTION_REFUSED = "connection refused"  # how a dead process's address answers (gRPC's reason, lowercased)


def process_gone(reason: str) -> bool:
    """Whether a failed call's reason says nothing listens at the peer's address any more: its
    process is dead (a restarted one listens elsewhere, under a new incarnation)."""
    return CONNECTION_REFUSED in reason.lower()
