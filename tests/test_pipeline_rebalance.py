"""The coordinator's stage rebalancing rule alone (coordinator/rebalance.py); wired into the stage
leases, it is tested in tests/test_stage_board.py."""

from __future__ import annotations

import pytest

from murmur.coordinator.rebalance import Rebalancer


def test_an_empty_stage_is_refilled_at_once_from_a_stage_that_keeps_a_peer():
    r = Rebalancer(3)
    move = r.check({0: {"a": 10.0, "b": 10.0, "c": 9.0}, 1: {"d": 10.0}, 2: {}})
    assert move is not None and move.reason == "empty stage"
    assert move.from_stage == 0 and move.to_stage == 2 and move.node_id in {"a", "b", "c"}
    # one move at a time: nothing else until the mover holds its new stage
    assert r.check({0: {"a": 10.0, "b": 10.0}, 1: {}, 2: {}}) is None
    r.completed(move.node_id)
    assert r.check({0: {"a": 10.0, "b": 10.0}, 1: {}, 2: {"c": 9.0}}).to_stage == 1


def test_a_stage_with_one_peer_never_gives_it_away():
    r = Rebalancer(2)
    assert r.check({0: {"a": 10.0}, 1: {}}) is None  # no donor can spare a peer


def test_the_bottleneck_gets_a_peer_only_after_two_agreeing_checks_and_a_clear_gain():
    r = Rebalancer(2)
    stages = {0: {"a": 10.0, "b": 10.0, "c": 10.0}, 1: {"d": 10.0}}  # min 10 -> 20 after a move
    assert r.check(stages) is None  # first check: proposed only
    move = r.check(stages)
    assert move is not None and move.reason == "bottleneck"
    assert (move.from_stage, move.to_stage) == (0, 1)
    assert move.old_min == pytest.approx(10.0) and move.new_min == pytest.approx(20.0)


def test_a_small_gain_or_a_change_of_mind_moves_nobody():
    r = Rebalancer(2)
    balanced = {0: {"a": 10.0, "b": 10.0}, 1: {"c": 9.0, "d": 9.0}}  # a move would lower the minimum
    assert r.check(balanced) is None and r.check(balanced) is None
    r2 = Rebalancer(2)
    skewed = {0: {"a": 10.0, "b": 10.0, "c": 10.0}, 1: {"d": 10.0}}
    assert r2.check(skewed) is None
    assert r2.check(balanced) is None  # the second check disagrees: no move
    assert r2.check(skewed) is None  # and the count starts again


def test_a_heavier_stage_counts_a_newcomer_at_its_own_pace():
    # Peers of stage 1 are half as fast: a peer moved there adds half its stage-0 rate.
    r = Rebalancer(2)
    stages = {0: {"a": 20.0, "b": 20.0, "c": 20.0, "e": 20.0}, 1: {"d": 10.0, "f": 10.0}}
    r.check(stages)
    move = r.check(stages)
    assert move is not None and move.new_min == pytest.approx(30.0)  # 20 + 20 * 0.5
