"""The values a training window takes and hands back, and the error training raises.

A window (node/daemon/window.py) trains on leased spans of the run's shards (`LeaseView`, as the
coordinator granted it; `Segment`, the tokens of one lease the window consumed), asks for the next
lease through a `LeaseSource` (the training thread's bridge to the coordinator session), and ends
with a `WindowResult`; with sync.fill_wait the steps it trained while its round was in flight are a
`Carry` for the next window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from murmur.errors import MurmurError


class TrainingError(MurmurError):
    pass


@dataclass(slots=True)
class LeaseView:
    """The part of a coordinator lease the training thread needs."""

    lease_id: str
    shard_id: int
    start_offset: int  # the shard's committed offset when leased: training starts here
    end_offset: int  # the shard's size in tokens


@dataclass(slots=True)
class Segment:
    """Tokens [start, end) of one lease consumed within the current window."""

    lease: LeaseView
    start: int
    end: int
    exhausted: bool = False  # the shard has no full batch left: commit up to its end


@dataclass(slots=True)
class WindowResult:
    round: int
    steps: int  # this window's share (the steps it ran; with sync.fill_wait, ``carried`` come on top)
    loss: float
    tokens: int
    seconds: float
    compute_seconds: float
    segments: list[Segment] = field(default_factory=list)
    stopped: bool = False  # the window ended early because a stop was asked for
    exchange_wait_seconds: float = 0.0  # of ``seconds``: training blocked on the exchange
    started: float = 0.0  # wall clock (time.time()) at the window's start
    arrived: float = 0.0  # wall clock when its last step had computed (before any wait for the round)
    filled: int = 0  # sync.fill_wait: steps trained while its round was in flight (carried to the next)
    carried: int = 0  # sync.fill_wait: the last window's filled steps, committed with this one (not in ``steps``)
    carried_shards: list[int] = field(default_factory=list)  # the shards those carried steps trained on


@dataclass(slots=True)
class Carry:
    """Steps trained while a window's round was in flight (sync.fill_wait): the next window's."""

    segments: list[Segment] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


class LeaseSource(Protocol):
    """Blocks until the coordinator grants a lease; None when the node should stop instead. It gets
    the segment of the shard that just ran out (or None): that lease stays held, exhausted, and is
    committed with the window whose steps trained it (the coordinator would otherwise hand it back
    until its shard is done). Given such a segment, and no other shard free, it may also return
    None at once without a stop (``can_end_dry``): the window then ends dry (`_dry_steps`).
    ``give_up`` (sync.fill_wait's lease while a round is in flight): also None once it says so
    after a refusal, rather than waiting for a shard to come free."""

    def __call__(self, done: Segment | None, give_up: Callable[[], bool] | None = None) -> LeaseView | None: ...
