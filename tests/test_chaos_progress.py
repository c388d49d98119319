"""Progress counted honestly (node/testnet/chaos.py): rounds by group size, and each restart's
time from its process start to the first round its update reached, read from round records."""

from __future__ import annotations

from murmur.node.testnet.chaos import group_sizes, percentile, restart_times


def _rec(name: str, t: float, round_id: int, peers: int = 2, contributed: bool = True) -> dict:
    return {"name": name, "time": t, "round": round_id, "peers": peers, "contributed": contributed, "loss": 1.0}


def test_a_restart_counts_until_its_first_round_that_reached_the_model_not_a_left_out_one():
    recs = [
        _rec("n0", 10.0, 1),
        _rec("n0", 25.0, 5, peers=1, contributed=False),  # caught up: its update was left out
        _rec("n0", 27.5, 6),
        _rec("n1", 12.0, 1),
    ]
    # n0 restarted at 20 s: its first round with its update in is at 27.5 s.
    assert restart_times(recs, [(20.0, "n0")]) == ([7.5], 0)


def test_a_restart_killed_again_before_any_round_is_counted_apart_and_the_next_one_measured():
    recs = [_rec("n0", 40.0, 9), _rec("n1", 15.0, 3)]
    # n0 restarted at 10 s and again at 30 s: the round at 40 s belongs to the second restart.
    # n1 restarted at 50 s and the span ended before it trained.
    times, without = restart_times(recs, [(10.0, "n0"), (30.0, "n0"), (50.0, "n1")])
    assert times == [10.0] and without == 2


def test_rounds_by_group_size_counts_each_round_once_in_the_span_by_its_largest_group():
    by_round = {
        1: [_rec("a", 1.0, 1, peers=1)],  # before the span
        2: [_rec("a", 5.0, 2, peers=2), _rec("b", 5.1, 2, peers=2)],
        3: [_rec("a", 6.0, 3, peers=1), _rec("b", 6.2, 3, peers=3), _rec("c", 6.3, 3, peers=3)],
        4: [_rec("a", 7.0, 4, peers=1)],
    }
    assert group_sizes(by_round, 4.0, 10.0) == {"1": 1, "2": 1, "3": 1}


def test_percentile_is_the_nearest_rank_and_none_when_empty():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
