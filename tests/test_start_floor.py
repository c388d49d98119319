"""The floor a node's start puts under its first round (node/exchange/start_floor.py): the peers
its --min-peers wait counted are waited for at the rendezvous until they met once."""

from __future__ import annotations

from murmur.node.exchange.start_floor import StartFloor


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_wait_no_floor():
    floor = StartFloor()
    assert floor.need() == 1
    floor.hold({"me"}, 1, 60.0)  # --min-peers 1: nothing was waited for
    assert floor.need() == 1
    floor.hold({"me", "a"}, 1, 60.0)
    assert floor.need() == 1


def test_the_counted_peers_are_waited_for_until_as_many_met_once():
    floor = StartFloor(clock=Clock())
    floor.hold({"me", "a", "b"}, 2, 60.0)  # three records seen, two wanted: the floor is two
    assert floor.need() == 2
    floor.met(1)  # alone at the rendezvous: still held
    assert floor.need() == 2
    floor.met(2)
    assert floor.need() == 1
    floor.met(1)  # later rounds alone are the run's own business (quorum), not the start's
    assert floor.need() == 1


def test_the_floor_lapses_after_the_starts_wait_and_says_so():
    clock, said = Clock(), []
    floor = StartFloor(log=said.append, clock=clock)
    floor.hold({"me", "a"}, 2, 60.0)
    clock.now += 59.9
    assert floor.need() == 2 and said == []
    clock.now += 0.2
    assert floor.need() == 1
    assert len(said) == 1 and "never met at a rendezvous" in said[0]
    assert floor.need() == 1 and len(said) == 1  # said once


def test_a_counted_peer_seen_dead_is_not_waited_for():
    dead: set[str] = set()
    floor = StartFloor(dead=lambda: dead, clock=Clock())
    floor.hold({"me", "a", "b"}, 3, 60.0)
    assert floor.need() == 3
    dead.add("b")  # its address refused a connection
    assert floor.need() == 2
    dead.add("a")
    assert floor.need() == 1
