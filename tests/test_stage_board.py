"""The coordinator's stage leases on a real SQLite ledger: assignment, refill, moves, restarts."""

from __future__ import annotations

import json

import pytest

from murmur.coordinator.stage_board import BadStageReport, NotPipelined, StageBoard
from murmur.coordinator.store import Store
from murmur.protocol import coordinator_pb2 as pb

PIPELINED = "[pipeline]\nstages = 2\nrebalance_every_s = 5.0\n"


class World:
    """A ledger with a pipelined and a data-parallel run, a clock and a set of live nodes."""

    def __init__(self, path) -> None:
        self.path, self.now, self.live, self.whole = path, 1000.0, set(), True
        self.store = Store(path)
        with self.store.write():
            self.store.insert_run("pipe", "pipe", PIPELINED, "{}", [], self.now)
            self.store.insert_run("dp", "dp", "", "{}", [], self.now)
        self.board = self.open()

    def open(self) -> StageBoard:
        return StageBoard(self.store, self.live.__contains__, lambda: self.whole, clock=lambda: self.now)

    def beat(self, node: str, stage: int, rate: float = 10.0, run: str = "pipe") -> pb.StageOrder | None:
        self.live.add(node)
        return self.board.report(node, run, pb.StageReport(stage=stage, samples_per_s=rate, replica_stage=-1,
                                                           address=f"{node}:1", state_address=f"{node}:2"))

    def join(self, node: str, rate: float = 10.0) -> int:
        """A new peer takes the stage it is assigned and reports serving it."""
        stage = self.beat(node, -1, rate).stage
        assert self.beat(node, stage, rate) is None
        return stage

    def events(self, kind: str) -> list[dict]:
        return [{"node": e["node_id"], **json.loads(e["detail_json"])} for e in self.store.events(kind=kind)]


@pytest.fixture
def world(tmp_path):
    w = World(tmp_path / "ledger.db")
    yield w
    w.store.close()


def test_new_peers_fill_the_emptiest_stage_and_serve_once_they_report_it(world):
    orders = [world.beat(n, -1) for n in ("a", "b")]
    assert [(o.stage, o.reason) for o in orders] == [(0, "assigned"), (1, "assigned")]
    assert world.beat("a", -1).stage == 0  # repeated until it serves it
    assert world.beat("a", 0) is None and world.beat("b", 1) is None
    assert world.beat("c", -1).stage == 0  # ties go to the least throughput, then the lowest stage
    rows = {r["node_id"]: (r["stage"], r["state"]) for r in world.store.stage_leases()}
    assert rows == {"a": (0, "serving"), "b": (1, "serving"), "c": (0, "joining")}
    assert [e["stage"] for e in world.events("stage_serving")] == [0, 1]


def test_an_emptied_stage_is_refilled_at_once_and_the_move_completes_when_the_peer_reports_it(world):
    assert [world.join(n) for n in "abcd"] == [0, 1, 0, 1]
    assert world.board.tick() == []
    world.live -= {"b", "d"}  # both peers of stage 1 are lost
    (move,) = world.board.tick()
    assert (move.to_stage, move.reason) == (1, "empty stage")
    assert move.node_id in ("a", "c")
    assert {e["node"] for e in world.events("stage_lost")} == {"b", "d"}
    assert world.beat(move.node_id, 0).stage == 1  # the order, while it still serves stage 0
    view = world.board.stage_map("pipe")
    assert view.pending_move and [s.peers for s in view.summary] == [2, 0]
    assert world.board.tick() == []  # one move at a time
    assert world.beat(move.node_id, 1) is None
    view = world.board.stage_map("pipe")
    assert not view.pending_move and [s.peers for s in view.summary] == [1, 1]
    assert "-> 1 (empty stage)" in view.summary[1].last_move


def test_a_peer_restarted_under_its_node_id_replaces_its_entry_and_refills_its_own_stage(world):
    assert [world.join(n) for n in "ab"] == [0, 1]
    # "b" is SIGKILLed and restarted with its state folder: the same node id, a new process that
    # reports no stage while it loads, at new addresses.
    world.live.add("b")
    rep = pb.StageReport(stage=-1, replica_stage=-1, state_address="b:new-state")
    order = world.board.report("b", "pipe", rep)
    assert (order.stage, order.reason) == (1, "restarted")  # back to its own stage
    view = world.board.stage_map("pipe")
    listed = [p for p in view.peers if p.node_id == "b"]
    # once, with the new report: the dead process's address is gone
    assert len(listed) == 1 and listed[0].report.stage == -1 and listed[0].report.address == ""
    assert (listed[0].assigned_stage, listed[0].assignment) == (1, "joining")
    assert [s.peers for s in view.summary] == [1, 0]
    assert world.board.tick() == []  # being refilled by "b": stage 1 is not emptied onto "a"
    assert world.board.report("b", "pipe", rep).stage == 1  # said again while it loads, one event only
    assert [e["stage"] for e in world.events("stage_restarted")] == [1]
    assert world.beat("b", 1) is None
    rows = {r["node_id"]: (r["stage"], r["state"]) for r in world.store.stage_leases()}
    assert rows == {"a": (0, "serving"), "b": (1, "serving")}
    assert [p.report.address for p in world.board.stage_map("pipe").peers] == ["a:1", "b:1"]


def test_a_bottleneck_move_waits_for_the_check_period_and_two_agreeing_checks(world):
    for node, stage, rate in (("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0), ("d", 1, 5.0)):
        world.beat(node, stage, rate)  # started on stages of their own choosing
    assert world.board.tick() == []  # first check: proposed, not issued
    world.now += 1.0
    assert world.board.tick() == []  # not yet due
    world.now += 5.0
    (move,) = world.board.tick()
    assert (move.from_stage, move.to_stage, move.reason) == (0, 1, "bottleneck")
    assert world.events("stage_move")[0]["reason"] == "bottleneck"


def test_a_restarted_coordinator_keeps_the_leases_and_the_move_under_way(world):
    assert [world.join(n) for n in "abc"] == [0, 1, 0]
    world.live.discard("b")
    (move,) = world.board.tick()
    world.whole = False  # just restarted: nobody has heartbeat yet
    world.board = world.open()
    assert world.board.tick() == []  # no move before the view is whole
    world.whole = True
    assert world.beat(move.node_id, 0).stage == 1  # the order survived the restart
    other = "c" if move.node_id == "a" else "a"
    assert world.beat(other, 0) is None
    assert world.board.tick() == []  # the move under way still blocks another
    assert world.beat(move.node_id, 1) is None
    assert [s.peers for s in world.board.stage_map("pipe").summary] == [1, 1]


def test_reports_from_a_data_parallel_run_or_of_a_stage_that_does_not_exist_are_refused(world):
    with pytest.raises(NotPipelined, match="not pipelined"):
        world.beat("x", -1, run="dp")
    with pytest.raises(BadStageReport, match="stage 7 is not a stage of run pipe"):
        world.beat("y", 7)
    assert world.store.stage_leases() == []


def test_a_move_the_peer_never_completes_is_given_up_and_the_next_one_may_come(world):
    assert [world.join(n) for n in "abc"] == [0, 1, 0]
    world.live.discard("b")
    (move,) = world.board.tick()
    world.beat(move.node_id, 0)  # it keeps serving stage 0 and never reports stage 1
    world.now += world.board.move_timeout_s + 1
    other = "c" if move.node_id == "a" else "a"
    world.beat(other, 0)
    (again,) = world.board.tick()  # given up; the refill is tried anew
    assert [e["to_stage"] for e in world.events("stage_move_abandoned")] == [1]
    assert again.to_stage == 1 and again.reason == "empty stage"


def test_a_report_with_a_nan_rate_or_huge_strings_is_kept_small_and_finite(world):
    world.live.add("z")
    world.board.report("z", "pipe", pb.StageReport(stage=0, samples_per_s=float("nan"), queue=-5, replica_stage=-1,
                                                   address="x" * 10_000, state_source="s" * 500))
    (peer,) = world.board.stage_map("pipe").peers
    assert peer.report.samples_per_s == 0.0 and peer.report.queue == 0
    assert len(peer.report.address) == 200 and len(peer.report.state_source) == 20
    assert world.board.tick() == []  # the rebalancing's arithmetic sees no NaN


def test_the_rebalancing_ranks_stages_by_what_the_drivers_measured_not_by_each_peers_claim(world):
    # By their own claims stage 0 (3 x 1 samples/s) is the bottleneck and stage 1 (50) has plenty;
    # the drivers measured stage 0's peers at 8 each and stage 1's only peer at 2: stage 1 is the
    # bottleneck, and it gets a peer of stage 0.
    for node, stage, claim in (("a", 0, 1.0), ("b", 0, 1.0), ("c", 0, 1.0), ("d", 1, 50.0)):
        world.beat(node, stage, claim)
    world.live.add("drv")
    measured = [pb.MeasuredRate(node_id=n, stage=0, samples_per_s=8.0) for n in "abc"]
    measured.append(pb.MeasuredRate(node_id="d", stage=1, samples_per_s=2.0))
    measured.append(pb.MeasuredRate(node_id="d", stage=1, samples_per_s=float("nan")))  # ignored
    measured.append(pb.MeasuredRate(node_id="stranger", stage=1, samples_per_s=1e9))  # not a peer of the run
    world.board.measured("drv", "pipe", measured)
    assert [s.samples_per_s for s in world.board.stage_map("pipe").summary] == [24.0, 2.0]
    assert world.board.tick() == []  # proposed
    world.now += 6.0
    world.board.measured("drv", "pipe", measured[:4])
    (move,) = world.board.tick()
    assert (move.from_stage, move.to_stage, move.reason) == (0, 1, "bottleneck")
    # measurements go stale: after MEASURED_FRESH_S the peers' own claims count again
    world.now += 31.0
    assert [s.samples_per_s for s in world.board.stage_map("pipe").summary] == [3.0, 50.0]
