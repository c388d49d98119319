"""Chaos on a local testnet: random SIGKILLs and restarts, and what the run made of them.

`Chaos` kills a random live node now and then (exponential gaps with mean ``mtbf_s``, seeded) and
restarts it from its state folder ``restart_delay_s`` later; call ``tick()`` as often as you like.
`analyze` reads what every node recorded (its rounds.jsonl: round, hash, time, tokens, peers) and
the coordinator's ledger, and says what the issue-14 benchmark and the churn tests check:

* rounds: distinct rounds completed by the run, and the longest stall between two new rounds;
* hash agreement: every record of one round (across nodes and restarts) holds the same state hash;
* split-brain rounds: rounds recorded with two state hashes, at any time: two lineages of the
  run (a node that trained alone from an old state while the others went on is one, even when its
  round numbers lag far behind theirs). A node that caught up (came late, took the result from
  the group that completed the round) records that group's hash: not a split;
* the ledger: tokens committed equal the sum of the shards' committed offsets (every token counted
  once) and never exceed the tokens the recorded rounds trained into the model (a window whose
  update was left out is not counted: its tokens are trained again; ``windows_left_out``);
* progress counted honestly: tokens the ledger committed per minute over the span (rounds alone
  overstate it: a round of one member trains one node's tokens), the span's rounds by group size,
  and for every restart the seconds from its process start to its first round whose update
  reached the model (``restart_s``; a restart that trained no such round before the span ended
  is counted in ``restarts_without_round``, not in the times).

Used by `murmur testnet chaos`, benchmarks/chaos.py and tests/test_churn_*.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from murmur.node.daemon.state_dir import read_rounds
from murmur.node.testnet.procs import NodeProc, Testnet


@dataclass(slots=True)
class Chaos:
    net: Testnet
    mtbf_s: float
    seed: int = 0
    restart_delay_s: float = 3.0
    kills: list[tuple[float, str]] = field(default_factory=list)  # (time.time(), node name)
    restarts: int = 0
    restarted: list[tuple[float, str]] = field(default_factory=list)  # (time.time() at its start, node name)
    _rng: random.Random = field(init=False)
    _next_kill: float = field(init=False)
    _due: list[tuple[float, NodeProc]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._next_kill = time.monotonic() + self._rng.expovariate(1 / self.mtbf_s)

    def tick(self, kill: bool = True) -> str:
        """Kill and restart as due; returns a note on the latest kill ("" if none now)."""
        now, note = time.monotonic(), ""
        if kill and now >= self._next_kill:
            victims = [n for n in self.net.nodes if n.alive()]
            if victims:
                victim = self._rng.choice(victims)
                self.net.kill_node(victim)
                self.kills.append((time.time(), victim.name))
                self._due.append((now + self.restart_delay_s, victim))
                note = f"chaos: killed {victim.name}"
            self._next_kill = now + self._rng.expovariate(1 / self.mtbf_s)
        for due, node in list(self._due):
            if now >= due:
                self._restart(node)
                self._due.remove((due, node))
        return note

    def pending(self) -> list[NodeProc]:
        """Killed nodes not restarted yet."""
        return [n for _, n in self._due]

    def finish(self) -> None:
        """Restart every node still down (the run's end is not a crash)."""
        for _, node in self._due:
            self._restart(node)
        self._due.clear()

    def _restart(self, node: NodeProc) -> None:
        self.restarted.append((time.time(), node.name))
        self.net.start_node(node)
        self.restarts += 1


def round_records(net: Testnet) -> list[dict]:
    """Every trained round any node recorded (a restarted node's earlier records included)."""
    out = []
    for node in net.nodes:
        out += [{**r, "name": node.name} for r in read_rounds(node.state_dir) if "loss" in r]
    return out


def analyze(
    net: Testnet,
    started_at: float,
    ended_at: float,
    *,
    restarted: Sequence[tuple[float, str]] = (),
    committed_before: int = 0,
) -> dict:
    """What the run made of the chaos (see the module docstring); ``started_at``/``ended_at`` in
    time.time(), the span the stall and the rates are measured over; ``restarted``: (start time,
    node name) of each restart (`Chaos.restarted`); ``committed_before``: tokens the ledger had
    committed at ``started_at``."""
    recs = round_records(net)
    by_round: dict[int, list[dict]] = {}
    for r in recs:
        by_round.setdefault(int(r["round"]), []).append(r)
    first_done = sorted(min(float(r["time"]) for r in rs) for rs in by_round.values())
    marks = [started_at, *first_done, ended_at]
    stall = max((b - a for a, b in zip(marks, marks[1:], strict=False)), default=ended_at - started_at)
    disagree = {n for n, rs in by_round.items() if len({r["hash"] for r in rs}) > 1}
    status = net.admin("status", "--run", net.run_id)
    shards = net.admin("shards", "list", "--run", net.run_id)["shards"]
    committed = int(status["run"]["tokens_committed"])
    offsets = sum(int(s["committed_offset"]) for s in shards)
    # Tokens that reached the model: a window whose update a round left out trained tokens the
    # ledger must not count (the node trains them again), so they are not counted here either.
    trained = sum(int(r.get("tokens", 0)) for r in recs if r.get("contributed", True))
    minutes = max(ended_at - started_at, 1e-9) / 60
    restart_s, without = restart_times(recs, restarted)
    return {
        "rounds": len(by_round),
        "max_round": max(by_round, default=0),
        "max_stall_s": round(stall, 1),
        "hash_agreement": not disagree,
        "split_brain_rounds": len(disagree),
        "tokens_committed": committed,
        "tokens_trained": trained,
        "windows_left_out": sum(1 for r in recs if r.get("contributed") is False),
        "ledger_exact": committed == offsets and committed <= trained,
        "tokens_lost": max(0, trained - committed),
        "tokens_per_min": round((committed - committed_before) / minutes) if ended_at > started_at else 0,
        "rounds_by_group_size": group_sizes(by_round, started_at, ended_at),
        "restart_s": restart_s,
        "restarts_without_round": without,
    }


def group_sizes(by_round: dict[int, list[dict]], started_at: float, ended_at: float) -> dict[str, int]:
    """How many of the rounds first completed in the span had 1, 2, ... members (the largest
    group any record of the round names: a member that caught up records the group it adopted)."""
    sizes: dict[int, int] = {}
    for rs in by_round.values():
        if started_at <= min(float(r["time"]) for r in rs) <= ended_at:
            k = max(int(r.get("peers", 1)) for r in rs)
            sizes[k] = sizes.get(k, 0) + 1
    return {str(k): sizes[k] for k in sorted(sizes)}


def restart_times(recs: list[dict], restarted: Sequence[tuple[float, str]]) -> tuple[list[float], int]:
    """Seconds from each restart to that node's first round after it whose update reached the model
    (sorted), and how many restarts had none (killed again first, or the span ended)."""
    starts: dict[str, list[float]] = {}
    for t, name in restarted:
        starts.setdefault(name, []).append(t)
    times, without = [], 0
    for name, ts in starts.items():
        mine = sorted(float(r["time"]) for r in recs if r["name"] == name and r.get("contributed", True))
        ts = sorted(ts)
        for i, t in enumerate(ts):
            until = ts[i + 1] if i + 1 < len(ts) else float("inf")  # the next restart of the same node
            first = next((x for x in mine if t < x < until), None)
            if first is None:
                without += 1
            else:
                times.append(round(first - t, 1))
    return sorted(times), without


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by the nearest rank; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]
