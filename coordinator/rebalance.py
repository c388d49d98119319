"""Rebalancing of pipeline stages: which peer should move to which stage, decided centrally.

coordinator/stage_board.py keeps the stage leases and calls this: every ``rebalance_every_s``
(and at once when a stage is left empty) it hands `Rebalancer.check` the live stage peers and
the throughput (samples/s) each reported in its heartbeats. The rule, after Petals and SWARM, with the fixes their users
asked for:

- A stage with no peer is refilled at once: the peer whose departure costs the pipeline least
  (from a stage that keeps at least one peer) moves there, no second check needed.
- Otherwise the bottleneck is the stage of least total throughput. The candidate move takes one
  peer of the most over-served stage (the greatest throughput, at least two peers) to the
  bottleneck; its rate there is estimated from its own rate scaled by how fast peers of the two
  stages are on average (stages may cost differently). The move is worth it when the pipeline's
  minimum grows by a clear margin: ``old_min / new_min < balance_quality`` (Petals' 0.75, a gain
  of a third).
- A move is issued only when two consecutive checks propose the same one (petals PR #493: a
  single noisy measurement must not cost a reload).
- One move at a time: until the moving peer reports that it holds its new stage's state (it keeps
  serving its old stage meanwhile), no other move is issued.
- A stage that a new peer is loading (``filling``) is not empty, and while any is loading no
  bottleneck move is considered: its throughput is not known yet.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

BALANCE_QUALITY = 0.75  # Petals' default: move when old_min / new_min < this


@dataclass(frozen=True, slots=True)
class Move:
    node_id: str
    from_stage: int
    to_stage: int
    reason: str  # "empty stage" | "bottleneck"
    old_min: float  # the pipeline's throughput before, samples/s
    new_min: float  # its estimate after


def stage_throughput(stages: Mapping[int, Mapping[str, float]]) -> dict[int, float]:
    return {s: sum(peers.values()) for s, peers in stages.items()}


class Rebalancer:
    def __init__(self, n_stages: int, balance_quality: float = BALANCE_QUALITY) -> None:
        if not 0 < balance_quality < 1:
            raise ValueError(f"balance_quality must be in (0, 1), not {balance_quality}")
        self.n_stages, self.balance_quality = n_stages, balance_quality
        self.pending: Move | None = None  # issued, not yet completed
        self._proposed: Move | None = None  # proposed by the last check, not yet confirmed

    def check(self, stages: Mapping[int, Mapping[str, float]], filling: Collection[int] = ()) -> Move | None:
        """The move to issue now, if any. ``stages``: stage -> {node id: samples/s} of the peers
        serving it; ``filling``: stages a new peer is loading the state of."""
        full = {s: dict(stages.get(s, {})) for s in range(self.n_stages)}
        if self.pending is not None:
            return None
        move = self._refill(full, set(filling))
        if move is None and not filling:
            move = self._rebalance(full)
        if move is None:
            self._proposed = None
            return None
        if move.reason == "empty stage" or _same(move, self._proposed):
            self._proposed = None
            self.pending = move
            return move
        self._proposed = move
        return None

    def completed(self, node_id: str) -> None:
        """The moving peer holds its new stage's state and serves it: the next move may come."""
        if self.pending is not None and self.pending.node_id == node_id:
            self.pending = None

    def abandoned(self, node_id: str) -> None:
        """The moving peer left (or failed to fetch the state): forget the move."""
        self.completed(node_id)

    # -- the rule --------------------------------------------------------------------------------

    def _refill(self, stages: dict[int, dict[str, float]], filling: set[int]) -> Move | None:
        empty = [s for s, peers in stages.items() if not peers and s not in filling]
        if not empty:
            return None
        target = empty[0]
        old = stage_throughput(stages)
        best: Move | None = None
        for s, peers in stages.items():
            if len(peers) < 2:
                continue
            for node_id, rate in peers.items():
                after = dict(old)
                after[s] -= rate
                after[target] = rate * _scale(stages, s, target)
                new_min = min(after.values())
                if best is None or new_min > best.new_min:
                    best = Move(node_id, s, target, "empty stage", 0.0, new_min)
        return best

    def _rebalance(self, stages: dict[int, dict[str, float]]) -> Move | None:
        tput = stage_throughput(stages)
        bottleneck = min(tput, key=lambda s: (tput[s], s))
        donors = [s for s in tput if s != bottleneck and len(stages[s]) >= 2]
        if not donors:
            return None
        donor = max(donors, key=lambda s: (tput[s], -s))
        old_min = tput[bottleneck]
        best: Move | None = None
        for node_id, rate in stages[donor].items():
            after = dict(tput)
            after[donor] -= rate
            after[bottleneck] += rate * _scale(stages, donor, bottleneck)
            new_min = min(after.values())
            if best is None or new_min > best.new_min:
                best = Move(node_id, donor, bottleneck, "bottleneck", old_min, new_min)
        if best is None or best.new_min <= 0 or old_min / best.new_min >= self.balance_quality:
            return None
        return best


def _scale(stages: Mapping[int, Mapping[str, float]], src: int, dst: int) -> float:
    """How a peer's rate on ``src`` translates to ``dst``: the ratio of the stages' mean per-peer
    rates (1 when ``dst`` has no peer to compare with)."""
    a, b = stages[src], stages[dst]
    if not a or not b:
        return 1.0
    mean_a, mean_b = sum(a.values()) / len(a), sum(b.values()) / len(b)
    return mean_b / mean_a if mean_a > 0 else 1.0


def _same(a: Move, b: Move | None) -> bool:
    return b is not None and (a.node_id, a.from_stage, a.to_stage) == (b.node_id, b.from_stage, b.to_stage)
