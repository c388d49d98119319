"""The split rules of coordinator/trainers.py, on the class itself (the gRPC paths are in
test_coordinator_membership.py): commits are judged by node ids, claims by processes."""

from __future__ import annotations

import pytest

from murmur.coordinator.trainers import SplitRound, Trainers

RUN = "run"


def beat(t: Trainers, node: str, incarnation: str = "i1") -> None:
    t.update(node, RUN, incarnation, f"127.0.0.1:{1000 + int(node[1:])}", 5, "ab")


def test_a_commit_group_sharing_no_member_with_the_rounds_group_is_refused_even_as_a_majority():
    """Round 5's commits named n1-n3; n1-n3 are lost and n6, n7 come in. A commit of round 5 by
    n4-n6, a majority of the four live trainers now, shares no member with the group that
    completed round 5: a split, refused. (Node ids are compared whole: a rule meant for
    restarted processes once compared their first letters, and every node id starts with n.)"""
    t = Trainers(settle_s=0.0)
    for n in ("n1", "n2", "n3", "n4", "n5"):
        beat(t, n)
    t.check_round(RUN, "n1", 5, ["n1", "n2", "n3"], lambda n: True)
    for n in ("n1", "n2", "n3"):
        t.drop(n)
    for n in ("n6", "n7"):
        beat(t, n)
    with pytest.raises(SplitRound, match="completed by 3 other members"):
        t.check_round(RUN, "n4", 5, ["n4", "n5", "n6"], lambda n: True)
    t.check_round(RUN, "n4", 5, ["n3", "n4", "n5"], lambda n: True)  # overlaps: granted


def test_a_claim_is_judged_by_processes_and_regranted_only_when_every_member_is_back():
    t = Trainers(settle_s=0.0)
    for n in ("n1", "n2", "n3"):
        beat(t, n)
    assert t.claim(RUN, 7, "k", ["n1", "n2"], lambda n: True, run_round=8)
    assert t.run_round(RUN, "n3") == 8 and t.run_round(RUN, "n1") == 8
    beat(t, "n1", "i2")  # n1 restarted from before round 7 (and reported its new address)
    with pytest.raises(SplitRound, match="other processes"):
        t.claim(RUN, 7, "k", ["n1", "n3"], lambda n: True)
    beat(t, "n2", "i2")  # n2 too: nobody holds round 7's result any more
    assert t.claim(RUN, 7, "k", ["n1", "n2"], lambda n: True)
    assert t.claim(RUN, 9, "k", ["n3"], lambda n: n == "n3", run_round=10)  # a lone live trainer
    assert t.run_round(RUN, "n3") == 8 and t.run_round(RUN, "n1") == 10


def test_one_live_process_at_a_time_numbers_its_own_state_as_a_lost_round():
    """n1 and n2 come back behind the run at once, every holder of rounds 8-9 gone, from different
    checkpoints: only the first to claim numbers its state as round 9 (two would give round 9 two
    states, and average every later round from two bases). The same process may ask again; once
    it is lost or restarted, the number is free for another node."""
    t = Trainers(settle_s=0.0)
    for n in ("n1", "n2"):
        beat(t, n)
    live = {"n1", "n2"}
    t.claim_lost_rounds(RUN, 9, "n1", live.__contains__)
    t.claim_lost_rounds(RUN, 9, "n1", live.__contains__)  # asked again: still its number
    with pytest.raises(SplitRound, match="n1 goes on from its own state as round 9"):
        t.claim_lost_rounds(RUN, 9, "n2", live.__contains__)
    t.claim_lost_rounds(RUN, 10, "n2", live.__contains__)  # another round's number is another claim
    beat(t, "n1", "i2")  # n1 restarted: the process granted round 9 is gone
    t.claim_lost_rounds(RUN, 9, "n2", live.__contains__)
    live.discard("n2")  # n2 lost: n1's new process may take the number
    t.claim_lost_rounds(RUN, 9, "n1", live.__contains__)
    with pytest.raises(SplitRound, match="heartbeat first"):
        t.claim_lost_rounds(RUN, 9, "n3", live.__contains__)


def test_a_granted_rounds_commit_is_not_refused_as_a_minority_of_trainers_that_came_later():
    """n1 trains alone (the only live trainer) and is granted rounds 4-6; its checkpoint is slow,
    so their commits arrive after n2 has joined and settled. The grant judged those rounds
    against the trainers live when they were claimed: the commits are the run's progress. A
    round nobody granted this group is still judged against the trainers live now."""
    t = Trainers(settle_s=0.0)
    beat(t, "n1")
    for r in (4, 5, 6):
        assert t.claim(RUN, r - 1, "diloco/0", ["n1"], lambda n: True, run_round=r)
    beat(t, "n2")
    for r in (4, 5, 6):
        t.check_round(RUN, "n1", r, ["n1"], lambda n: True)
    with pytest.raises(SplitRound, match="minority group is a split"):
        t.check_round(RUN, "n1", 7, ["n1"], lambda n: True)
