"""The coordinator's view of the live trainers as a node keeps it: the quorum base counts the
trainers the DHT announces that no view listed yet (a slower peer whose first heartbeat as a
trainer is on its way), and not those that were listed and are gone."""

from __future__ import annotations

from murmur.node.daemon.run_view import RunView
from murmur.protocol import coordinator_pb2 as pb


def member(node_id: str) -> pb.LiveMember:
    return pb.LiveMember(node_id=node_id, incarnation="i", peer_address=f"{node_id}:1", round=1)


def test_a_trainer_the_dht_announces_but_no_view_listed_yet_counts_for_the_quorum():
    view = RunView("fast", "i", fresh_s=60.0)
    view.update([member("fast")])  # the coordinator has heard of one trainer so far
    assert view.quorum_base() == 1
    # the DHT announces the slower one: a group of the fast one alone is no majority of 2
    assert view.quorum_base({"fast", "slow"}) == 2
    assert view.expected() == 1  # the rendezvous does not wait for it: it meets again if short


def test_a_trainer_that_was_listed_and_is_gone_does_not_count_though_its_record_lingers():
    view = RunView("a", "i", fresh_s=60.0)
    view.update([member("a"), member("b")])
    view.update([member("a")])  # b was lost: the coordinator no longer lists it
    assert view.quorum_base({"a", "b"}) == 1
    view.saw_refusal("c", "c:1", "connection refused")  # never listed, and its address refuses
    assert view.quorum_base({"a", "c"}) == 1
