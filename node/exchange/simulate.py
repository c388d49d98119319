"""The bounded groups at a scale one machine cannot hold: rounds of the real group formation and
failure rules over a simulated transport.

``simulate_rounds(peers=1000, group_size=16, numel=..., codec="int4", kills_per_round=1, rounds=20,
seed=0)`` plays each round as node/exchange/hierarchy.py runs it: the live trainers formed into
groups by node/exchange/groups.py's ``form_groups`` (the same function the peers call), the
column holders by ``holders``; a group that loses its quorum fails (no fallback to halves). Bytes are
the wire bytes of the codec itself (``Codec.encode`` of a chunk, scaled), per phase: a group's
reduce-scatter (each member's input to the other owners' blocks: about (G-1)/G of the update,
nothing back), a column's 2(M-1)/M of one column, the group's gather (each owner's columns to
its k-1 group-mates: about (G-1)/G).

Kills: ``kills_per_round`` trainers die each round, at a moment drawn in proportion to each
phase's bytes (a long phase is more likely to be hit), and come back for the next round (a
restart). The rules, as the exchange applies them:

* in the group reduce-scatter (A): the attempt fails at every member of that group; they retry
  without the dead (its input dropped with its weight); the bytes of the failed attempt are
  spent (half of it on average). The group completes if it keeps more than half of its members
  (the exchange's quorum), else it fails;
* as a column holder in B or C: its group-mates fetch its columns' results from the other groups'
  holders (they hold the same bytes) and complete. A holder dead in B leaves its group out of
  its columns (a weighted mean of the other groups for them); with M = 2 groups that column's
  call has no quorum anywhere, and no group completes the round.

A round completes when more than half of its live trainers hold the result (the run's quorum).
Returns a dict: the rows a benchmark writes (rounds, rounds_complete, bytes_per_peer,
connections_per_peer, peers_completed, groups_failed, ...).

Runs with torch only (no gRPC, no hivemind), so the GPU box's benchmarks can call it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from murmur.node.exchange.groups import Formation, column_block, form_groups
from murmur.optim.codecs import make_codec

QUORUM = 0.5  # ExchangeSettings.quorum's default: more than half of a call's scope


def codec_bytes_per_element(codec: str, probe: int = 1 << 16) -> float:
    """Wire bytes per fp32 element of ``codec``, measured on its own encoding of a chunk."""
    c = make_codec(codec)
    x = torch.randn(probe, generator=torch.Generator().manual_seed(0))
    return c.encode_stateless(x).nbytes / probe


@dataclass(slots=True)
class _Round:
    sent: dict[str, float]
    completed: set[str]
    groups_failed: int


def _a_bytes(k: int, s: int, rate: float, numel: int) -> list[float]:
    """Bytes each of ``k`` owners sends in a reduce-scatter of S columns: its input to every other
    owner's block (settings: ``column_block``), nothing back."""
    return [rate * numel * (1 - (hi - lo) / s) for lo, hi in (column_block(i, k, s) for i in range(k))]


def _bc_bytes(k: int, s: int, m: int, rate: float, numel: int) -> list[float]:
    """Bytes each of ``k`` owners sends in B (its block's columns, 2(M-1)/M of each) and C (the
    same columns to the k-1 others: a ragged gather, the unused slots empty)."""
    column = numel / s
    return [rate * column * (hi - lo) * (2 * (m - 1) / m + k - 1)
            for lo, hi in (column_block(i, k, s) for i in range(k))]


def _play_round(f: Formation, numel: int, rate: float, victims: dict[str, str], rng: random.Random) -> _Round:
    s, m = f.columns, len(f.groups)
    sent: dict[str, float] = {}
    completed: set[str] = set()
    failed = 0
    # A carrier dead in B with only one other group: that column's call has no quorum anywhere
    # (a strict majority of M = 2 is both), so no group can assemble the round.
    b_dead_lost = m == 2 and any(v == "B" for v in victims.values())
    for group in f.groups:
        g = len(group)
        dead_a = [n for n in group if victims.get(n) == "A"]
        alive = [n for n in group if n not in dead_a]
        # A: one reduce-scatter among the group. With a death in it, the failed attempt's bytes
        # (the part sent before it failed: uniform) and then the retry among the alive.
        first = rng.random() if dead_a else 1.0
        for n, b in zip(group, (_a_bytes(g, s, rate, numel) if not f.single else
                                [rate * numel * 2 * (g - 1) / g] * g), strict=True):
            sent[n] = sent.get(n, 0.0) + b * first
        if dead_a:
            k = len(alive)
            if k <= g * QUORUM:  # no quorum left: the group fails (no fallback to halves)
                alive = []
            retry = _a_bytes(len(alive), s, rate, numel) if not f.single else \
                [rate * numel * 2 * (len(alive) - 1) / max(len(alive), 1)] * len(alive)
            for n, b in zip(alive, retry, strict=True):
                sent[n] += b
        if not alive:
            failed += 1
            continue
        if f.single:  # one group: the round of before, one butterfly and nothing else
            dead_later = [n for n in group if victims.get(n) in ("B", "C")]
            completed.update(n for n in alive if n not in dead_later)
            continue
        for n, b in zip(alive, _bc_bytes(len(alive), s, m, rate, numel), strict=True):
            sent[n] += b
        if b_dead_lost:
            failed += 1
            continue
        # A holder dead in B or C: its group-mates fetch its columns' results from the other
        # groups' holders (node/exchange/hierarchy.py's repair); the group completes without it.
        completed.update(n for n in alive if victims.get(n) not in ("B", "C"))
    return _Round(sent, completed, failed)


def simulate_rounds(
    peers: int,
    group_size: int,
    numel: int,
    codec: str = "int4",
    kills_per_round: int = 0,
    rounds: int = 10,
    seed: int = 0,
) -> dict:
    rng = random.Random(seed)
    rate = codec_bytes_per_element(codec)
    nodes = [f"n{i:05d}" for i in range(peers)]
    complete = 0
    bytes_sent: list[float] = []
    completed_share: list[float] = []
    groups_failed = 0
    connections = 0
    for r in range(1, rounds + 1):
        f = form_groups("sim", r, "update", nodes, group_size)
        g_max = max(len(g) for g in f.groups)
        m, column = len(f.groups), numel / f.columns
        weights = {"A": numel, "B": column * 2 * (m - 1) / m, "C": column * (g_max - 1)}  # each phase's bytes
        victims = {n: rng.choices(list(weights), list(weights.values()))[0]
                   for n in rng.sample(nodes, min(kills_per_round, peers))}
        played = _play_round(f, numel, rate, victims, rng)
        complete += len(played.completed) > QUORUM * peers
        bytes_sent.extend(played.sent[n] for n in nodes if n not in victims)
        completed_share.append(len(played.completed) / peers)
        groups_failed += played.groups_failed
        # A peer's connections, on average: the other members of its group (A, C), and for each
        # column it holds (S/g of them) the other groups' holders of it (B).
        if f.single:
            connections = max(connections, g_max - 1)
        else:
            per = [len(g) - 1 + (len(f.groups) - 1) * f.columns / len(g) for g in f.groups]
            connections = max(connections, round(sum(p * len(g) for p, g in zip(per, f.groups, strict=True)) / peers))
    flat = rate * numel * 2 * (peers - 1) / peers
    mean_bytes = sum(bytes_sent) / len(bytes_sent) if bytes_sent else 0.0
    return {
        "peers": peers,
        "group_size": group_size,
        "groups": len(form_groups("sim", 1, "update", nodes, group_size).groups),
        "numel": numel,
        "codec": codec,
        "kills": kills_per_round,
        "rounds": rounds,
        "rounds_complete": complete,
        "one_hash": True,  # by construction: every column's bytes are decoded alike (real tests check it)
        "bytes_per_peer": round(mean_bytes),
        "bytes_per_peer_butterfly": round(flat),  # one all-reduce of all peers, for comparison
        "connections_per_peer": connections,
        "connections_per_peer_butterfly": peers - 1,
        "peers_completed": round(sum(completed_share) / rounds, 4),
        "groups_failed": groups_failed,
        "link": "simulated",
    }
