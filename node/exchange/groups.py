"""Bounded groups: which trainers all-reduce together in a round, computed alike on every peer.

A round of N live trainers runs its all-reduce in ``ceil(N / G)`` groups of at most G
(``sync.group_size``) peers, combined into one result for the whole run by the hierarchical
all-reduce of node/exchange/hierarchy.py. The formation is a pure function of (run, round, the
live trainers, G): every peer computes it from the same inputs with no message of its own, and it
changes from round to round (the order is a hash of the round) and whenever the live set changes.
Groups are balanced: their sizes differ by one at most. A run of G trainers or fewer is one group
under the round's own key, exactly the round of before.

Keys. Group g of M meets under ``<key>/g<g>of<M>`` and the span holders of column c under
``<key>/c<c>of<M>``: M is part of the key, so peers whose views of the live set differ in size
meet apart instead of mixing two formations under one key (and fail or catch up there). Column
c is the element range c of the update cut into S spans, S = the smallest group's size: every
group has at least S members, so every column has a holder in every group.

Falling back: a group whose rendezvous or attempts fail (its key lost or overloaded, too many of
its peers dead) splits: ``split(formation, g)`` halves it into two groups with keys of their own
(``<key>/g<g>of<M>h<0|1>``), so the peers that are there finish with smaller groups instead of
failing everyone's round. Columns stay as they were (S of the first formation), so the split
halves still hold every column (a half of k survivors holds column c at survivor c mod k).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_GROUP_SIZE = 16  # sync.group_size's default: a butterfly of 16 is 15 connections a peer
MIN_GROUP_SIZE = 2


class GroupFormationError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Formation:
    """One round's groups (each sorted), and the key they were formed for."""

    key: str
    groups: tuple[tuple[str, ...], ...]
    # A digest of the live set the groups were formed from, in every key of the round: peers
    # whose views differ (a join or a death seen a heartbeat apart) meet apart, never mixing two
    # formations' groups or columns under one key, and fail or retry that round instead.
    tag: str = ""

    @property
    def single(self) -> bool:
        """One group: the round runs exactly as a round without groups (same key, same members)."""
        return len(self.groups) == 1

    @property
    def columns(self) -> int:
        """S: spans of the column phase, the smallest group's size."""
        return min(len(g) for g in self.groups)

    def group_of(self, node_id: str) -> int:
        for i, g in enumerate(self.groups):
            if node_id in g:
                return i
        raise GroupFormationError(f"{node_id} is not one of this round's {sum(map(len, self.groups))} live trainers")

    def group_key(self, g: int) -> str:
        return self.key if self.single else f"{self.key}/g{g}of{len(self.groups)}{self.tag}"

    def column_key(self, c: int) -> str:
        return f"{self.key}/c{c}of{len(self.groups)}{self.tag}"

    def gather_key(self, g: int) -> str:
        return f"{self.group_key(g)}/gather"


def _order(run_id: str, round_id: int, node_id: str) -> bytes:
    return hashlib.sha256(f"{run_id}\x00{round_id}\x00{node_id}".encode()).digest()


def form_groups(run_id: str, round_id: int, key: str, live: Iterable[str], group_size: int) -> Formation:
    """The round's groups: the live trainers ordered by a hash of (run, round, node id) and dealt
    round-robin into ceil(N / G) groups, so sizes differ by one at most and nobody chooses its group."""
    if group_size < MIN_GROUP_SIZE:
        raise GroupFormationError(f"sync.group_size must be at least {MIN_GROUP_SIZE}, got {group_size}")
    nodes = sorted(set(live))
    if not nodes:
        raise GroupFormationError("no live trainers to form groups of")
    if len(nodes) <= group_size:
        return Formation(key, (tuple(nodes),))
    m = math.ceil(len(nodes) / group_size)
    dealt = sorted(nodes, key=lambda n: _order(run_id, round_id, n))
    tag = "." + hashlib.sha256("\x00".join(nodes).encode()).hexdigest()[:8]
    return Formation(key, tuple(tuple(sorted(dealt[g::m])) for g in range(m)), tag)


def split(members: Sequence[str], key: str) -> list[tuple[str, tuple[str, ...]]]:
    """A failed group's fallback: its members halved (sorted order), each half under a key of its
    own. A group of one cannot split: it is returned as it is."""
    members = sorted(members)
    if len(members) < 2:
        return [(key, tuple(members))]
    half = (len(members) + 1) // 2
    return [(f"{key}h0", tuple(members[:half])), (f"{key}h1", tuple(members[half:]))]


def holders(survivors: Sequence[str], columns: int) -> dict[int, str]:
    """Column -> the member of a group that carries it through the column phase: survivor c mod k
    of the group's k survivors (sorted). A group of S members holds one column each; one that lost
    members holds several with its survivors."""
    survivors = sorted(survivors)
    if not survivors:
        return {}
    return {c: survivors[c % len(survivors)] for c in range(columns)}
