"""Bounded groups: which trainers all-reduce together in a round, computed alike on every peer.

A round of N live trainers runs its all-reduce in ``ceil(N / G)`` groups of at most G
(``sync.group_size``) peers, combined into one result for the whole run by the hierarchical
all-reduce of node/exchange/hierarchy.py. The formation is a pure function of (run, round, the
live trainers, G): every peer computes it from the same inputs with no message of its own, and it
changes from round to round (the order is a hash of the round) and whenever the live set changes.
Groups are balanced: their sizes differ by one at most. A run of G trainers or fewer is one group
under the round's own key, exactly the round of before.

Keys. Group g of M meets under ``<key>/g<g>of<M>`` and the holders of column c under
``<key>/c<c>of<M>``. Only M is in the key, not the live set: peers whose views differ by a
trainer or two (a death seen a heartbeat apart, a dead peer's record not yet expired) still meet
their group-mates under the same keys, and the rendezvous, not the view, decides who is in: a
peer never takes part in two groups, so the groups stay a partition of whoever came, and the
result is one. Views that differ in M (a join or a death across a multiple of G) meet apart: a
group of the minority's keys lacks a quorum and fails, or catches the round up from its peers.
Column c is the element range c of the update cut into S = G spans: the same for every view of
the live set (the layout of phases B and C must be), and at least every group's size, so each
survivor of a group's reduce-scatter holds a contiguous block of one column or more.

No fallback to smaller groups: a half of a group meets a quorum of a quarter of it, and the
halves of a minority's formation (a view of the live set short of peers) could complete a result
of their own. A group that cannot meet fails its round; its peers catch it up from group-mates
that completed it, if any (node/exchange/hierarchy.py).
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
    """One round's groups (each sorted), the key they were formed for, and S: the columns of the
    column phase (``sync.group_size``: the same for every view of the live set)."""

    key: str
    groups: tuple[tuple[str, ...], ...]
    columns: int = 1

    @property
    def single(self) -> bool:
        """One group: the round runs exactly as a round without groups (same key, same members)."""
        return len(self.groups) == 1

    def group_of(self, node_id: str) -> int:
        for i, g in enumerate(self.groups):
            if node_id in g:
                return i
        raise GroupFormationError(f"{node_id} is not one of this round's {sum(map(len, self.groups))} live trainers")

    def group_key(self, g: int) -> str:
        return self.key if self.single else f"{self.key}/g{g}of{len(self.groups)}"

    def column_key(self, c: int) -> str:
        return f"{self.key}/c{c}of{len(self.groups)}"

    def gather_key(self, g: int) -> str:
        return f"{self.group_key(g)}/gather"


def _order(run_id: str, round_id: int, node_id: str) -> bytes:
    return hashlib.sha256(f"{run_id}\x00{round_id}\x00{node_id}".encode()).digest()


def form_groups(run_id: str, round_id: int, key: str, live: Iterable[str], group_size: int) -> Formation:
    """The round's groups: the live trainers ordered by a hash of (run, round, node id) and cut
    into ceil(N / G) contiguous runs of that order, so sizes differ by one at most, nobody chooses
    its group, and two views of the live set one trainer apart (a death seen a heartbeat apart)
    put all but M - 1 trainers in the same groups: each boundary moves by one at most."""
    if group_size < MIN_GROUP_SIZE:
        raise GroupFormationError(f"sync.group_size must be at least {MIN_GROUP_SIZE}, got {group_size}")
    nodes = sorted(set(live))
    if not nodes:
        raise GroupFormationError("no live trainers to form groups of")
    if len(nodes) <= group_size:
        return Formation(key, (tuple(nodes),))
    n, m = len(nodes), math.ceil(len(nodes) / group_size)
    order = sorted(nodes, key=lambda node: _order(run_id, round_id, node))
    cuts = [g * n // m for g in range(m + 1)]
    return Formation(key, tuple(tuple(sorted(order[cuts[g] : cuts[g + 1]])) for g in range(m)), group_size)


def column_block(owner: int, owners: int, columns: int) -> tuple[int, int]:
    """[lo, hi) of the columns that owner ``owner`` of ``owners`` reduces in a reduce-scatter cut
    into ``columns`` columns: contiguous blocks, as even as whole columns allow (an owner may get
    none when there are more owners than columns)."""
    return -(-owner * columns // owners), -(-(owner + 1) * columns // owners)


def column_owner(column: int, owners: int, columns: int) -> int:
    """The index of the owner whose ``column_block`` holds ``column``."""
    return column * owners // columns


def holders(owners: Sequence[str], columns: int) -> dict[int, str]:
    """Column -> the member of a group that carries it through the column phase: the owner whose
    block of the group's reduce-scatter holds it (settings.column_block: owner i of k holds the
    columns c with c*k // S == i). A group of S owners holds one column each; one that lost
    members holds two with some of its owners (contiguous, so each owner's span is one range)."""
    owners = sorted(owners)
    if not owners:
        return {}
    return {c: owners[column_owner(c, len(owners), columns)] for c in range(columns)}
