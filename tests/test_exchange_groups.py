"""Bounded groups (node/exchange/groups.py) and the hierarchical all-reduce that makes one result of
them (node/exchange/hierarchy.py): the formation as a pure function, and 24 real exchange peers
(TLS servers on loopback, one process, one loop) in groups of 8 ending with one result."""

from __future__ import annotations

import time

import pytest
import torch
from _net_helpers import no_lost_task_exceptions, peer_group  # noqa: F401 - a fixture

from murmur.node.exchange.groups import GroupFormationError, form_groups, holders
from murmur.node.exchange.hierarchy import GroupedExchange, round_members
from murmur.node.exchange.settings import chunk_ranges
from murmur.optim.exchange import ExchangeError
from murmur.protocol import peer_pb2
from murmur.protocol.wire import tensors_hash, wire_to_proto

TIMEOUT = 120  # seconds a test waits for a round: 24 peers on a busy 2-core machine

NODES = [f"n{i:03d}" for i in range(100)]


def test_formation_is_the_same_for_the_same_round_and_live_set_wherever_it_is_computed():
    a = form_groups("run", 7, "update", NODES[:40], 8)
    b = form_groups("run", 7, "update", list(reversed(NODES[:40])), 8)  # another peer's order
    assert a == b
    assert len(a.groups) == 5 and sorted(n for g in a.groups for n in g) == NODES[:40]
    assert {len(g) for g in a.groups} == {8} and a.columns == 8
    assert len({a.group_key(g) for g in range(5)}) == 5 and a.column_key(0) == "update/c0of5"
    # Another view of the live set, one trainer apart (a death seen a heartbeat apart): the same
    # keys and columns, and all but M - 1 = 4 trainers in the same groups (each boundary of the
    # hashed order moves by one at most), so the two views' peers still meet their group-mates.
    dead = a.groups[2][3]
    other = form_groups("run", 7, "update", [n for n in NODES[:40] if n != dead], 8)
    assert [other.group_key(g) for g in range(5)] == [a.group_key(g) for g in range(5)] and other.columns == 8
    moved = [n for n in NODES[:40] if n != dead and a.group_of(n) != other.group_of(n)]
    assert len(moved) <= 4, moved


def test_formation_changes_when_the_live_set_or_the_round_changes():
    base = form_groups("run", 7, "update", NODES[:40], 8)
    assert form_groups("run", 7, "update", NODES[:39], 8) != base  # one trainer gone
    assert form_groups("run", 7, "update", NODES[:41], 8) != base  # one came
    assert form_groups("run", 8, "update", NODES[:40], 8) != base  # the next round mixes the groups
    assert form_groups("other", 7, "update", NODES[:40], 8) != base


def test_groups_are_balanced_and_a_small_run_is_one_group_under_its_own_key():
    f = form_groups("run", 1, "update", NODES[:41], 8)
    assert len(f.groups) == 6 and {len(g) for g in f.groups} == {6, 7} and f.columns == 8  # S = G
    small = form_groups("run", 1, "update", NODES[:16], 16)
    assert small.single and small.groups == (tuple(NODES[:16]),) and small.group_key(0) == "update"
    with pytest.raises(GroupFormationError, match="at least 2"):
        form_groups("run", 1, "update", NODES, 1)


def test_every_column_has_a_holder_in_every_group_even_after_losses():
    assert holders(["b", "a", "c"], 5) == {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}  # contiguous blocks


def test_a_round_is_claimed_for_its_own_group_survivors_and_the_groups_it_met():
    f = form_groups("run", 3, "update", NODES[:9], 3)
    g = f.group_of(NODES[0])
    mine = [m for m in f.groups[g] if m != f.groups[g][-1]]  # one of ours dropped in phase A
    others = [h for h in range(3) if h != g]
    assert round_members(f, g, mine) == sorted({*mine, *f.groups[others[0]], *f.groups[others[1]]})
    # A group whose holder never came to our column calls: not in the round we claim.
    assert round_members(f, g, mine, met={g, others[0]}) == sorted({*mine, *f.groups[others[0]]})


def assert_one_result_the_mean(results, xs) -> None:
    """Every peer holds the same result, and it is the mean of ``xs`` to int8's tolerance: int8 is
    applied five times on the way (inputs, group result, column input, column result, gathered
    column), each within 1/127 of a block's absmax."""
    assert len({tensors_hash([("0", r.tensors[0])]) for r in results}) == 1, "every peer holds the same result"
    mean = torch.stack(xs).mean(0)
    scale = max(x.abs().max().item() for x in xs)
    assert (results[0].tensors[0] - mean).abs().max().item() <= 5 * 2 / 127 * scale


def grouped(peers, group_size: int) -> list[GroupedExchange]:
    ids = [p.node_id for p in peers]
    return [GroupedExchange(p.exchange, run_id="test-run", live=lambda: ids, group_size=group_size) for p in peers]


def test_24_peers_in_groups_of_8_end_the_round_with_one_result_the_mean_of_all_inputs():
    n, numel = 24, 3000
    with peer_group(n, codec="int8") as (_, peers, _):
        exchanges = grouped(peers, 8)
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        futs = [e.all_reduce([x], round_id=1, key="update") for e, x in zip(exchanges, xs, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        assert len(exchanges[0].last.groups) == 3
        assert_one_result_the_mean(results, xs)
        # Connections: a peer's calls touched its group (8) and its column (3), not 24 peers.
        assert all(r.dropped == {} for r in results)
        # Each result names the whole round (what a node claims and commits with), not its group.
        assert all(r.members == sorted(p.node_id for p in peers) for r in results)
        # Bytes: against one butterfly of all 24, 2(N-1)/N of the update's chunk frames (what the
        # exchange counts; one such round of 24 measured exactly this, but it is the round that
        # fails on a loaded machine, which is why groups exist).
        codec = peers[0].exchange.codec
        frames = sum(
            peer_pb2.Payload(tensors=[wire_to_proto(codec.encode_stateless(torch.zeros(b - a)))]).ByteSize()
            for a, b in chunk_ranges(numel, 64)
        )
        butterfly = 2 * (n - 1) / n * frames
        grouped_bytes = sum(r.bytes_sent for r in results) / n
        print(f"bytes a peer: grouped {grouped_bytes:.0f}, one butterfly {butterfly:.0f}")
        assert grouped_bytes <= 1.6 * butterfly  # docs/protocol.md, "Groups": about 1.5x, the design's limit


def test_a_holder_too_slow_for_its_groups_gather_is_replaced_by_the_other_groups_holders_of_its_column():
    """6 peers in 2 groups of 3 (3 columns, one a member). One peer reaches its group's gather
    (phase C) long after its group-mates gave up waiting for it: they take its column's result
    from the other group's holder of that column (the same bytes, fetched and hash-checked), it
    takes the gather's result from them, and all six end with one result, the mean of all inputs."""
    n, numel = 6, 600
    with peer_group(n, codec="int8", peer_timeout=1.0) as (_, peers, _):
        exchanges = grouped(peers, 3)
        slow = peers[0]
        slow.faults.arm("delay", peer=slow.node_id, round=1, point="group_gather", seconds=4.0)
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        futs = [e.all_reduce([x], round_id=1, key="update") for e, x in zip(exchanges, xs, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        assert_one_result_the_mean(results, xs)
        slow_group = exchanges[0].last.groups[exchanges[0].last.group_of(slow.node_id)]
        mates = [i for i, p in enumerate(peers) if p.node_id in slow_group and p is not slow]
        # Its mates' gather went on without it and took its column from the other group (its
        # input is in the result all the same: nobody was dropped); its own caught up from them.
        assert all(exchanges[i].repaired for i in mates), [exchanges[i].repaired for i in mates]
        assert all(r.dropped == {} for r in results)
        assert (1, f"{exchanges[0].last.group_key(exchanges[0].last.group_of(slow.node_id))}/gather") in \
            slow.exchange.caught_up


def test_trainers_the_live_set_names_but_that_never_come_cost_their_groups_only_within_the_deadlines():
    """8 live trainers in 2 groups of 4, 4 of them gone before the round (their addresses never
    answer): a peer either completes (its group met, or a half of it did) or fails with one line,
    and none waits past the deadlines of its three phases."""
    deadline = 3.0
    with peer_group(4, codec="int8", round_deadline=deadline) as (_, peers, _):
        ids = [p.node_id for p in peers] + ["nGONE1", "nGONE2", "nGONE3", "nGONE4"]
        exchanges = [GroupedExchange(p.exchange, run_id="test-run", live=lambda: ids, group_size=4) for p in peers]
        t0 = time.monotonic()
        futs = [e.all_reduce([torch.ones(256)], round_id=1, key="update") for e in exchanges]
        outcomes = []
        for f in futs:
            try:
                outcomes.append(f.result(timeout=TIMEOUT))
            except ExchangeError as err:
                outcomes.append(err)
        # One round_deadline bounds the whole round, its three phases and its catch-up (a node
        # waits that long for its round), not one deadline a phase.
        assert time.monotonic() - t0 < deadline + 5
        errors = [str(o) for o in outcomes if isinstance(o, ExchangeError)]
        assert all("round 1" in e and "\n" not in e for e in errors), errors
        done = [o for o in outcomes if not isinstance(o, ExchangeError)]
        assert len({tensors_hash([("0", r.tensors[0])]) for r in done}) <= 1


def test_a_grouped_round_that_failed_everywhere_runs_again_under_the_same_round_and_keys_within_one_deadline():
    """A node whose round failed re-syncs and runs the same round again, from the same state, under
    the same keys. 4 peers in 2 groups of 2; one does not come: its mate's group cannot meet (a
    strict majority of 2 is 2) and the other group's phase A completes, but its column calls need
    the mate's group (M = 2). All three fail within one round deadline (not one a phase). Then all
    four run the round again: the completed phase A must not answer ALREADY_DONE (a reduce-scatter
    cannot be caught up), so the retry completes, one result, the mean of the four inputs."""
    deadline = 4.0
    with peer_group(4, codec="int8", round_deadline=deadline, peer_timeout=1.0) as (_, peers, _):
        exchanges = grouped(peers, 2)
        g = torch.Generator().manual_seed(11)
        xs = [torch.randn(512, generator=g) for _ in range(4)]
        absent = 3
        t0 = time.monotonic()
        futs = [e.all_reduce([x], round_id=1, key="update") for i, (e, x) in enumerate(zip(exchanges, xs, strict=True))
                if i != absent]
        for f in futs:
            with pytest.raises(ExchangeError, match="round 1"):
                f.result(timeout=TIMEOUT)
        assert time.monotonic() - t0 < deadline + 3
        assert all(not p.exchange.book.done for p in peers)  # nothing of the failed try answers ALREADY_DONE
        futs = [e.all_reduce([x], round_id=1, key="update") for e, x in zip(exchanges, xs, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        assert_one_result_the_mean(results, xs)
        assert all(r.dropped == {} for r in results)


def test_the_simulation_plays_the_real_formation_at_1000_peers_with_kills():
    from murmur.node.exchange.simulate import simulate_rounds

    row = simulate_rounds(1000, 16, 1 << 16, "int4", kills_per_round=1, rounds=10, seed=3)
    assert row == simulate_rounds(1000, 16, 1 << 16, "int4", kills_per_round=1, rounds=10, seed=3)
    assert row["groups"] == 63 and row["rounds_complete"] == 10
    assert row["peers_completed"] >= 0.95  # one kill a round costs one group of 16 at most
    assert row["connections_per_peer"] <= 16 - 1 + 63 - 1 < row["connections_per_peer_butterfly"]
    assert row["bytes_per_peer"] <= 1.6 * row["bytes_per_peer_butterfly"]
    small = simulate_rounds(8, 16, 1 << 16, "int4", rounds=2)
    assert small["bytes_per_peer"] == small["bytes_per_peer_butterfly"] and small["groups"] == 1
    none = simulate_rounds(64, 16, 1 << 16, "int4", kills_per_round=0, rounds=3)
    assert none["rounds_complete"] == 3 and none["peers_completed"] == 1.0 and none["groups_failed"] == 0
