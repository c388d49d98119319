"""Stage leases of pipelined runs: which stage each stage peer serves, and the rebalancing that moves them.

A run whose config has a ``[pipeline]`` section is served by stage peers (docs/pipeline.md).
Each one heartbeats a `StageReport`: the stage it serves now (-1 while it starts), its
addresses, its measured samples/s and queue. The coordinator answers with a `StageOrder` while
the stage its lease names is not the one it serves. The lease is a row of the ledger
(``stage_leases``), so a coordinator restart keeps every assignment and a move under way:

- **joining**: a new peer (stage -1) is given the stage with the fewest peers (ties: the least
  throughput, then the lowest index); it loads that stage's state and reports it, and the lease
  becomes **serving**. A peer started on a stage of its own choosing (``--stage``) has it as its
  lease from its first heartbeat.
- **moving**: `Rebalancer` (coordinator/rebalance.py) decided to move the peer; it keeps serving its
  old stage until it holds the new one's state, then reports the new stage (serving again). One
  move at a time per run; a stage left with no peer is refilled at once, other moves wait for
  ``rebalance_every_s`` and two agreeing checks.
- a peer that is lost, leaves or is banned loses its lease (``stage_lost``); a move it was
  making is forgotten.
- **restarting**: a peer restarted with its state folder keeps its node id (it rejoins without a
  token) and first reports no stage (-1). That report replaces the dead process's at once (the
  view lists the node once, at its new addresses, none while it loads), and its lease goes back to
  **joining** at its stage (``stage_restarted``): the stage counts as being refilled, by it, and the
  order it gets names that stage (a move it was making is given up).

**Whose throughput.** Each peer reports its own samples/s, but that is its compute rate on its own
stage: a stage of more blocks is slower per sample, and a peer may claim anything. Drivers measure
every peer they send hops to (forward-equivalent samples/s over whole calls, the wire included)
and heartbeat those rates; the rebalancing and the stage summary use the mean of the drivers'
fresh measurements of a peer (``MEASURED_FRESH_S``) and fall back to its own claim only when no
driver measured it lately.

**Checkpoints.** A stage peer with a state folder checkpoints its stage at the instants of the
clock ``pipeline.checkpoint_every_s`` apart (node/pipeline/stage_checkpoint.py): version v is the
instant ``v * checkpoint_every_s``. It reports each one with the member call `ReportCheckpoint`
(step: the version, location: ``stage/<s>``, sha256: the stage's state hash), a row of the ledger's
``checkpoints`` table. The newest *complete set* is the newest version that every stage has a
checkpoint of; each time it advances the ledger gets a ``stage_checkpoint_set`` event naming, for
every stage, its hash and the peers that hold it (`checkpoint_set`).

Every assignment, move and completion is an event in the ledger (``stage_assigned``,
``stage_move``, ``stage_serving``, ``stage_lost``). Reports live in memory: peers heartbeat
again within a second of a restart, and until the coordinator's view is whole (one heartbeat TTL
after it serves again) nothing is moved, so a peer not yet heard from is not taken for gone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from murmur.errors import MurmurError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.runconfig import ConfigError, PipelineSection, parse_config

from .rebalance import Move, Rebalancer
from .store import Store

# A peer that has not reported its new stage this long after it was told to move has failed the
# move (it could not load the state, or it ignores orders): the move is given up, its lease goes
# back to the stage it serves, and the next move may come. Loading a stage takes seconds.
MOVE_TIMEOUT_S = 120.0
# A driver's measurement of a peer counts this long (drivers heartbeat every second or so): a peer
# no driver sends hops to any more (benched, or gone) falls back to its own claim.
MEASURED_FRESH_S = 30.0


class NotPipelined(MurmurError):
    code = "FAILED_PRECONDITION"


class BadStageReport(MurmurError):
    code = "INVALID_ARGUMENT"


@dataclass(slots=True)
class StageLease:
    node_id: str
    run_id: str
    stage: int
    state: str  # joining | serving | moving
    from_stage: int
    reason: str
    since: float


class StageBoard:
    def __init__(
        self,
        store: Store,
        is_live: Callable[[str], bool],
        view_is_whole: Callable[[], bool],
        clock: Callable[[], float] = time.time,
        move_timeout_s: float = MOVE_TIMEOUT_S,
    ) -> None:
        self.store, self.is_live, self.view_is_whole, self.clock = store, is_live, view_is_whole, clock
        self.move_timeout_s = move_timeout_s
        self._leases: dict[str, StageLease] = {
            r["node_id"]: StageLease(
                r["node_id"], r["run_id"], r["stage"], r["state"], r["from_stage"], r["reason"], r["since"]
            )
            for r in store.stage_leases()
        }
        self._reports: dict[str, tuple[float, pb.StageReport]] = {}  # node -> (when, latest report)
        self._pipelines: dict[str, PipelineSection | None] = {}
        self._rebalancers: dict[str, Rebalancer] = {}
        # peer -> driver -> (when, samples/s the driver measured of the peer, the stage it was on)
        self._measured: dict[str, dict[str, tuple[float, float, int]]] = {}
        self._checked: dict[str, float] = {}  # run -> when its bottleneck was last checked
        self._last_move: dict[str, dict[int, tuple[str, float]]] = {}  # run -> stage -> (move, when)
        self._newest_set: dict[str, int] = {}  # run -> the newest complete checkpoint set recorded
        for lease in self._leases.values():  # a move under way when the coordinator stopped
            if lease.state == "moving":
                self._rebalancer(lease.run_id).pending = Move(
                    lease.node_id, lease.from_stage, lease.stage, lease.reason, 0.0, 0.0
                )

    # --- the run's pipeline ----------------------------------------------------------------------

    def pipeline(self, run_id: str) -> PipelineSection | None:
        if run_id not in self._pipelines:
            row = self.store.run(run_id)
            try:
                cfg = parse_config(row["config_toml"], "the run configuration") if row is not None else None
            except ConfigError:
                cfg = None
            self._pipelines[run_id] = cfg.pipeline if cfg is not None else None
        return self._pipelines[run_id]

    def _rebalancer(self, run_id: str) -> Rebalancer:
        if run_id not in self._rebalancers:
            pipe = self.pipeline(run_id)
            self._rebalancers[run_id] = Rebalancer(pipe.stages if pipe is not None else 1)
        return self._rebalancers[run_id]

    # --- heartbeats ------------------------------------------------------------------------------

    def report(self, node_id: str, run_id: str, rep: pb.StageReport) -> pb.StageOrder | None:
        """Record a stage peer's heartbeat; the order to send back while its lease names another stage."""
        pipe = self.pipeline(run_id)
        if pipe is None:
            raise NotPipelined(
                f"run {run_id} is not pipelined (its config has no [pipeline] section): stage peers cannot serve it"
            )
        for stage, what in ((rep.stage, "stage"), (rep.replica_stage, "replica_stage")):
            if not -1 <= stage < pipe.stages:
                raise BadStageReport(f"{what} {stage} is not a stage of run {run_id} (it has {pipe.stages})")
        now = self.clock()
        self._reports[node_id] = (now, _sane(rep))
        lease = self._leases.get(node_id)
        if lease is not None and rep.stage < 0 and lease.state != "joining":
            # A peer that served (or was moving) reports no stage: it restarted under its node id
            # (its state folder keeps it). Its new report replaced the dead process's above; its
            # stage counts as being filled (by it) rather than empty, and a move it was making is over.
            if lease.state == "moving":
                self._rebalancer(run_id).abandoned(node_id)
            lease.state, lease.reason, lease.since = "joining", "restarted", now
            self._put(lease, "stage_restarted", stage=lease.stage)
        if lease is None:
            if rep.stage >= 0:
                lease = StageLease(node_id, run_id, rep.stage, "serving", -1, "chosen by the peer", now)
            else:
                lease = StageLease(node_id, run_id, self._emptiest(run_id, pipe), "joining", -1, "assigned", now)
            self._put(lease, "stage_assigned", stage=lease.stage, state=lease.state, reason=lease.reason)
        if rep.stage == lease.stage:
            if lease.state != "serving":
                moved = lease.state == "moving"
                waited = round(now - lease.since, 3)
                lease.state, lease.since = "serving", now
                self._put(lease, "stage_serving", stage=lease.stage, seconds=waited, source=rep.state_source[:20])
                if moved:
                    self._rebalancer(run_id).completed(node_id)
            return None
        return pb.StageOrder(stage=lease.stage, reason=lease.reason)

    def _emptiest(self, run_id: str, pipe: PipelineSection) -> int:
        count = {s: 0 for s in range(pipe.stages)}
        rate = {s: 0.0 for s in range(pipe.stages)}
        for lease in self._live_leases(run_id):
            count[lease.stage] += 1
            rate[lease.stage] += self._rate(lease.node_id)
        return min(count, key=lambda s: (count[s], rate[s], s))

    def measured(self, driver_id: str, run_id: str, rates: list[pb.MeasuredRate]) -> None:
        """Record a driver's measurements of the run's stage peers (those of other runs, and rates
        that are not finite non-negative numbers, are ignored)."""
        now = self.clock()
        for m in rates:
            lease = self._leases.get(m.node_id)
            if lease is None or lease.run_id != run_id or not math.isfinite(m.samples_per_s) or m.samples_per_s < 0:
                continue
            self._measured.setdefault(m.node_id, {})[driver_id] = (now, m.samples_per_s, m.stage)

    def _rate(self, node_id: str) -> float:
        """The peer's throughput on the stage it serves now: the mean of the drivers' fresh
        measurements of it there, else its own claim."""
        entry = self._reports.get(node_id)
        stage = entry[1].stage if entry is not None else -1
        now = self.clock()
        fresh = [rate for at, rate, on in self._measured.get(node_id, {}).values()
                 if on == stage and now - at <= MEASURED_FRESH_S]
        if fresh:
            return sum(fresh) / len(fresh)
        return entry[1].samples_per_s if entry is not None else 0.0

    def _live_leases(self, run_id: str) -> list[StageLease]:
        return [lease for lease in self._leases.values() if lease.run_id == run_id and self.is_live(lease.node_id)]

    def _put(self, lease: StageLease, event: str, **detail: object) -> None:
        with self.store.write():
            self.store.put_stage_lease(
                lease.node_id, lease.run_id, lease.stage, lease.state, lease.from_stage, lease.reason, lease.since
            )
            self.store.event(event, run_id=lease.run_id, node_id=lease.node_id, **detail)
        self._leases[lease.node_id] = lease

    # --- the sweeper's check ---------------------------------------------------------------------

    def tick(self) -> list[Move]:
        """Drop the leases of peers that are gone; refill empty stages; check the bottleneck when
        due. Returns the moves issued."""
        if not self.view_is_whole():
            return []
        now = self.clock()
        moves = []
        for run_id in sorted({lease.run_id for lease in self._leases.values()}):
            for lease in [x for x in self._leases.values() if x.run_id == run_id]:
                if not self.is_live(lease.node_id):
                    self._drop(lease)
                elif lease.state == "moving" and now - lease.since > self.move_timeout_s:
                    self._give_up(lease, now)
            pipe = self.pipeline(run_id)
            if pipe is None:
                continue
            serving: dict[int, dict[str, float]] = {s: {} for s in range(pipe.stages)}
            filling: set[int] = set()
            for lease in self._live_leases(run_id):
                entry = self._reports.get(lease.node_id)
                if entry is not None and 0 <= entry[1].stage < pipe.stages:
                    serving[entry[1].stage][lease.node_id] = self._rate(lease.node_id)
                if lease.state == "joining":
                    filling.add(lease.stage)
            rebalancer = self._rebalancer(run_id)
            empty = any(not peers and s not in filling for s, peers in serving.items())
            if not empty and now - self._checked.get(run_id, now - pipe.rebalance_every_s) < pipe.rebalance_every_s:
                continue
            if not empty:
                self._checked[run_id] = now
            move = rebalancer.check(serving, filling)
            if move is not None:
                self._issue(run_id, move, now)
                moves.append(move)
        return moves

    def _issue(self, run_id: str, move: Move, now: float) -> None:
        lease = self._leases[move.node_id]
        lease.stage, lease.state, lease.from_stage, lease.reason, lease.since = (
            move.to_stage, "moving", move.from_stage, move.reason, now
        )
        self._put(
            lease, "stage_move", from_stage=move.from_stage, to_stage=move.to_stage, reason=move.reason,
            old_min=round(move.old_min, 3), new_min=round(move.new_min, 3),
        )
        text = _move_text(move.node_id, move.from_stage, move.to_stage, move.reason)
        self._moves(run_id)[move.to_stage] = (text, now)

    def _moves(self, run_id: str) -> dict[int, tuple[str, float]]:
        """The last move into each stage of the run (read back from the ledger after a restart)."""
        if run_id not in self._last_move:
            moves: dict[int, tuple[str, float]] = {}
            for ev in self.store.events(run_id=run_id, kind="stage_move", limit=1000):
                d = json.loads(ev["detail_json"])
                text = _move_text(ev["node_id"], d["from_stage"], d["to_stage"], d["reason"])
                moves[d["to_stage"]] = (text, ev["at"])
            self._last_move[run_id] = moves
        return self._last_move[run_id]

    def _give_up(self, lease: StageLease, now: float) -> None:
        entry = self._reports.get(lease.node_id)
        serves = entry[1].stage if entry is not None else -1
        target = lease.stage
        # back to what it serves (a peer that serves nothing joins its old stage again)
        lease.stage, lease.state = (serves, "serving") if serves >= 0 else (lease.from_stage, "joining")
        lease.reason, lease.since = "move given up", now
        self._put(lease, "stage_move_abandoned", to_stage=target, serves=serves,
                  waited_s=round(self.move_timeout_s, 1))
        self._rebalancer(lease.run_id).abandoned(lease.node_id)

    def _drop(self, lease: StageLease) -> None:
        with self.store.write():
            self.store.drop_stage_lease(lease.node_id)
            self.store.event("stage_lost", run_id=lease.run_id, node_id=lease.node_id, stage=lease.stage,
                             state=lease.state)
        self._leases.pop(lease.node_id, None)
        self._reports.pop(lease.node_id, None)
        self._measured.pop(lease.node_id, None)
        self._rebalancer(lease.run_id).abandoned(lease.node_id)

    # --- checkpoints -----------------------------------------------------------------------------

    def checkpoint_set(self, run_id: str) -> dict | None:
        """The run's newest complete set of stage checkpoints, from the ledger: ``{"version", "stages":
        [{"stage", "state_hash", "holders"}]}`` (None: no version has every stage yet). Stage-mates
        may hold different states of one version (they sync only every ``sync_every_samples``): the hash
        most of them hold is named (a tie: the smallest), with its holders."""
        pipe = self.pipeline(run_id)
        if pipe is None:
            return None
        by_version: dict[int, dict[int, dict[str, list[str]]]] = {}
        for row in self.store.checkpoints(run_id):
            stage = _stage_of(row["location"])
            if stage is None or not 0 <= stage < pipe.stages:
                continue
            by_version.setdefault(row["step"], {}).setdefault(stage, {}).setdefault(row["sha256"], []).append(
                row["node_id"])
        for version in sorted(by_version, reverse=True):
            stages = by_version[version]
            if len(stages) == pipe.stages:
                rows = []
                for s in range(pipe.stages):
                    digest, holders = min(stages[s].items(), key=lambda kv: (-len(kv[1]), kv[0]))
                    rows.append({"stage": s, "state_hash": digest, "holders": sorted(holders)})
                return {"version": version, "stages": rows}
        return None

    def checkpoint_reported(self, run_id: str) -> dict | None:
        """After a stage peer's `ReportCheckpoint`: record the newest complete set in the ledger
        when it advanced; returns it."""
        found = self.checkpoint_set(run_id)
        if run_id not in self._newest_set:  # after a restart: the last one recorded
            last = self.store.events(run_id=run_id, kind="stage_checkpoint_set", limit=1)
            self._newest_set[run_id] = json.loads(last[0]["detail_json"])["version"] if last else -1
        if found is not None and found["version"] > self._newest_set[run_id]:
            self._newest_set[run_id] = found["version"]
            with self.store.write():
                self.store.event("stage_checkpoint_set", run_id=run_id, **found)
        return found

    # --- who serves what -------------------------------------------------------------------------

    def stage_map(self, run_id: str) -> pb.StageMap:
        pipe = self.pipeline(run_id)
        out = pb.StageMap(run_id=run_id)
        if pipe is None:
            return out
        out.stages, out.rebalance_every_s = pipe.stages, pipe.rebalance_every_s
        out.tokens_committed = int(self.store.run_totals(run_id)["tokens_committed"])
        summary = {s: pb.StageSummary(stage=s, first_block=-1, end_block=-1) for s in range(pipe.stages)}
        for lease in sorted(self._live_leases(run_id), key=lambda x: (x.stage, x.node_id)):
            at, rep = self._reports.get(lease.node_id, (0.0, pb.StageReport(stage=-1)))
            out.peers.append(
                pb.StagePeerInfo(
                    node_id=lease.node_id, report=rep, assigned_stage=lease.stage, assignment=lease.state,
                    last_heartbeat=at,
                )
            )
            if 0 <= rep.stage < pipe.stages:
                row = summary[rep.stage]
                row.peers += 1
                row.samples_per_s += self._rate(lease.node_id)
                row.queue += rep.queue
                row.first_block, row.end_block = rep.first_block, rep.end_block
        for stage, (text, at) in self._moves(run_id).items():
            if stage in summary:
                summary[stage].last_move, summary[stage].last_move_at = text, at
        out.summary.extend(summary.values())
        pending = self._rebalancer(run_id).pending
        if pending is not None:
            out.pending_move = _move_text(pending.node_id, pending.from_stage, pending.to_stage, pending.reason)
        return out


def _sane(rep: pb.StageReport) -> pb.StageReport:
    """A copy of a peer's report that other members and the rebalancing can trust to be small and
    finite: strings capped, rates that are not finite non-negative numbers read as 0."""
    kept = pb.StageReport()
    kept.CopyFrom(rep)
    for name, cap in (("address", 200), ("state_address", 200), ("state_hash", 128), ("replica_hash", 128),
                      ("state_source", 20)):
        setattr(kept, name, getattr(kept, name)[:cap])
    for name in ("samples_per_s", "replica_at"):
        value = getattr(kept, name)
        if not math.isfinite(value) or value < 0:
            setattr(kept, name, 0.0)
    kept.queue = max(0, kept.queue)
    return kept


def _stage_of(location: str) -> int | None:
    """The stage of a checkpoint location ``stage/<s>`` (None: a data-parallel node's checkpoint)."""
    head, _, tail = location.partition("/")
    return int(tail) if head == "stage" and tail.isdigit() else None


def _move_text(node_id: str, from_stage: int, to_stage: int, reason: str) -> str:
    return f"{node_id[:12]}: stage {from_stage} -> {to_stage} ({reason})"
