"""The bounded groups at a scale one machine cannot hold: rounds of the real group formation and
failure rules over a simulated transport.

``simulate_rounds(peers=1000, group_size=16, numel=..., codec="int4", kills_per_round=1, rounds=20,
seed=0)`` plays each round as node/exchange/hierarchy.py runs it: the live trainers formed into
groups by node/exchange/groups.py's ``form_groups`` (the same function the peers call), the
column holders by ``holders``, a group that cannot meet its quorum split by ``split``. Bytes are
the wire bytes of the codec itself (``Codec.encode`` of a chunk, scaled), per phase: a group's
butterfly 2(G-1)/G of the update, a column's 2(M-1)/M of one column, the group's gather (G-1)/G.

Kills: ``kills_per_round`` trainers die each round, at a moment drawn in proportion to each
phase's bytes (a long phase is more likely to be hit), and come back for the next round (a
restart). The rules, as the exchange applies them:

* in the group all-reduce (A): the attempt fails at every member of that group; they retry
  without the dead (its input dropped with its weight); the bytes of the failed attempt are
  spent (half of it on average). The group completes if it keeps more than half of its members
  (the exchange's quorum), else it splits in halves once and the halves that still have a
  quorum complete;
* as a column holder (B) or in the gather (C): its group cannot assemble every column and fails
  the round (its survivors re-sync from the others' state); in B, the column it held goes on
  without its group (a weighted mean of the other groups for that column).

A round completes when more than half of its live trainers hold the result (the run's quorum).
Returns a dict: the rows a benchmark writes (rounds, rounds_complete, bytes_per_peer,
connections_per_peer, peers_completed, groups_failed, ...).

Runs with torch only (no gRPC, no hivemind), so the GPU box's benchmarks can call it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from murmur.node.exchange.groups import Formation, form_groups, split
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
    splits: int


def _phase_bytes(f: Formation, numel: int, rate: float) -> tuple[float, float, float]:
    """Bytes one member sends in A, B (per column held) and C, for a group of ``g`` at its size."""
    s, m = f.columns, len(f.groups)
    column = numel / s
    return rate * numel, rate * 2 * (m - 1) / m * column, rate * column


def _play_round(f: Formation, numel: int, rate: float, victims: dict[str, str], rng: random.Random) -> _Round:
    a_full, b_col, c_slot = _phase_bytes(f, numel, rate)
    sent: dict[str, float] = {}
    completed: set[str] = set()
    failed = splits = 0
    for group in f.groups:
        g = len(group)
        dead_a = [n for n in group if victims.get(n) == "A"]
        dead_later = [n for n in group if victims.get(n) in ("B", "C")]
        alive = [n for n in group if n not in dead_a]
        # A: one butterfly among the group, 2(g-1)/g of the update each (its own share as owner).
        # With a death in it, the failed attempt's bytes (the part sent before it failed: uniform)
        # and then the retry among the alive.
        first = rng.random() if dead_a else 1.0
        for n in group:
            sent[n] = sent.get(n, 0.0) + a_full * 2 * (g - 1) / g * first
        if dead_a:
            k = len(alive)
            if k <= g * QUORUM:
                splits += 1
                halves = [h for _, h in split(group, "")]
                alive = [n for h in halves for n in h if n not in dead_a
                         and sum(x not in dead_a for x in h) > len(h) * QUORUM]
            for n in alive:
                sent[n] += a_full * 2 * (len(alive) - 1) / max(len(alive), 1)
        if not alive:
            failed += 1
            continue
        if f.single:  # one group: the round of before, one butterfly and nothing else
            completed.update(n for n in alive if n not in dead_later)
            failed += bool(dead_later) and not completed
            continue
        k = len(alive)
        held = -(-f.columns // k)  # columns a survivor carries through B, slots it sends in C
        for n in alive:
            sent[n] += b_col * held + c_slot * held * (k - 1)
        if dead_later:
            failed += 1
            continue
        completed.update(alive)
    return _Round(sent, completed, failed, splits)


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
    groups_failed = splits = 0
    connections = 0
    for r in range(1, rounds + 1):
        f = form_groups("sim", r, "update", nodes, group_size)
        a_full, b_col, c_slot = _phase_bytes(f, numel, rate)
        g_max = max(len(g) for g in f.groups)
        weights = {"A": a_full * 2, "B": b_col, "C": c_slot * g_max}
        victims = {n: rng.choices(list(weights), list(weights.values()))[0]
                   for n in rng.sample(nodes, min(kills_per_round, peers))}
        played = _play_round(f, numel, rate, victims, rng)
        complete += len(played.completed) > QUORUM * peers
        bytes_sent.extend(played.sent[n] for n in nodes if n not in victims)
        completed_share.append(len(played.completed) / peers)
        groups_failed += played.groups_failed
        splits += played.splits
        # A peer's connections: the other members of its group (A, C), the other groups' holders
        # of its columns (B).
        g_min = min(len(g) for g in f.groups)
        connections = max(connections, g_max - 1 + (0 if f.single else (len(f.groups) - 1) * -(-f.columns // g_min)))
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
        "splits": splits,
        "link": "simulated",
    }
