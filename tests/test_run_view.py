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


def test_each_death_seen_is_queued_once_for_the_coordinator_and_wakes_the_reporter():
    """A refused connect is reported to the coordinator (ReportGone) once per (node, address),
    however often the rendezvous probes or the exchange see it, from whatever thread; a failure
    that does not say the process is gone (a timeout, a reset) is not a death and not reported."""
    import threading

    view = RunView("a", "i", fresh_s=60.0)
    view.update([member("a"), member("b"), member("c")])
    woken: list[str] = []
    view.on_gone = lambda: woken.append(threading.current_thread().name)
    assert not view.saw_refusal("b", "b:1", "no answer within 8s (stalled or gone)")
    assert view.take_gone() == [] and woken == []
    probe = threading.Thread(target=view.saw_refusal, args=("b", "b:1", "connection refused"), name="dht-worker")
    probe.start()
    probe.join()
    assert view.saw_refusal("b", "b:1", "Connection refused at its address")  # seen again: dead still
    assert view.saw_refusal("c", "c:1", "connection refused")
    assert not view.saw_refusal("a", "a:1", "connection refused")  # this node itself: never
    assert woken == ["dht-worker", "MainThread"]
    assert view.take_gone() == [("b", "b:1"), ("c", "c:1")]
    assert view.take_gone() == []
    # The coordinator then no longer lists them: the quorum counts the survivor alone.
    view.update([member("a")])
    assert view.quorum_base() == 1


def test_a_grouped_rounds_trainers_are_alike_whether_the_view_lists_the_others_with_their_address_yet_or_not():
    """A node names its peer address in its heartbeats a heartbeat after it holds a state: early in
    a run one node's view listed 2 trainers of 4 with an address, the others' 4. The groups must
    be formed from the same set on both (node/exchange/groups.py), or they meet under other keys."""
    from murmur.node.exchange.groups import form_groups

    announced = {"a", "b", "c", "d"}  # what every node's DHT shows
    early = RunView("a", "i", fresh_s=60.0)
    early.update([member("a"), member("b"), pb.LiveMember(node_id="c", incarnation="i"), pb.LiveMember(node_id="d")])
    whole = RunView("b", "i", fresh_s=60.0)
    whole.update([member(n) for n in sorted(announced)])
    assert early.round_trainers(announced) == whole.round_trainers(announced) == announced
    assert form_groups("run", 0, "k", early.round_trainers(announced), 2) == \
        form_groups("run", 0, "k", whole.round_trainers(announced), 2)
    # Gone (no longer listed) or seen dead: out, though its DHT record lingers.
    whole.update([member("a"), member("b"), member("c")])
    whole.saw_refusal("c", "c:1", "connection refused")
    assert whole.round_trainers(announced) == {"a", "b"}
    assert RunView("a", "i", fresh_s=60.0).round_trainers(announced) == set()  # no view yet: the DHT decides
