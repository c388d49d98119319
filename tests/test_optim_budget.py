"""Members of different speeds (optim/budget.py): each member's share of a round, the weighted
outer step through the real codecs, aggregators and DiLoCo, and the stretched fragment schedule."""

from __future__ import annotations

import threading

import pytest
import torch
from _optim_helpers import tiny_config
from torch import nn

from murmur.optim.aggregate import Aggregator
from murmur.optim.budget import BudgetError, SpeedMeter, member_steps
from murmur.optim.codecs import codec_from_config
from murmur.optim.diloco import DiLoCo, StreamingDiLoCo
from murmur.optim.inprocess import InProcessGroup


def test_each_member_trains_its_share_of_k_times_h_by_speed():
    # Speeds 1, 1, 1/2, 1/4 (slowdowns 1, 1, 2, 4): mean 0.6875, H=10.
    rates = [4.0, 4.0, 2.0, 1.0]
    shares = [member_steps(10, r, rates, max_ratio=4) for r in rates]
    assert shares == [15, 15, 7, 4]  # 10*4/2.75 = 14.5 -> 15 (round half to even), 7.27, 3.64
    # Clipped to [H/ratio, H*ratio]; unknown rates (0, NaN) are left out; unknown own rate: H.
    assert member_steps(10, 100.0, [100.0, 1.0], max_ratio=2) == 20
    assert member_steps(10, 1.0, [100.0, 1.0], max_ratio=2) == 5
    assert member_steps(10, 3.0, [3.0, 0.0, float("nan")], max_ratio=4) == 10
    assert member_steps(10, 0.0, rates, max_ratio=4) == 10
    assert member_steps(10, 2.0, [], max_ratio=4) == 10
    assert member_steps(1, 0.1, [10.0, 0.1], max_ratio=4) == 1  # never below one step
    with pytest.raises(BudgetError):
        member_steps(10, 1.0, [1.0], max_ratio=0.5)


def test_speed_meter_follows_a_change_within_a_few_windows():
    m = SpeedMeter()
    assert m.add(10, 0.0) == 0.0  # nothing measured
    assert m.add(10, 1.0) == 10.0
    for _ in range(3):
        m.add(10, 4.0)  # slowed 4x
    assert abs(m.rate - 2.5) < 1.0


def _reduce(group: InProcessGroup, contributions: dict[str, tuple[list[float], float]]) -> dict[str, list[float]]:
    futs = {
        p: group.exchange(p).all_reduce([torch.tensor(v)], round_id=0, key="k", weight=w)
        for p, (v, w) in contributions.items()
    }
    return {p: f.result(timeout=30).tensors[0].tolist() for p, f in futs.items()}


CONTRIB = {"a": ([1.0, 2.0, -4.0], 300.0), "b": ([3.0, 0.0, 8.0], 100.0), "c": ([-2.0, 6.0, 0.0], 600.0)}
# By hand: (300*a + 100*b + 600*c) / 1000
BY_HAND = [(300 * 1 + 100 * 3 - 600 * 2) / 1000, (600 + 0 + 3600) / 1000, (-1200 + 800 + 0) / 1000]


def test_the_weighted_average_equals_the_hand_computed_one():
    group = InProcessGroup(list(CONTRIB), lambda: codec_from_config(tiny_config().sync))  # fp32, mean
    for got in _reduce(group, CONTRIB).values():
        assert got == pytest.approx(BY_HAND, abs=1e-6)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_the_weighted_average_goes_through_the_lossy_codecs(codec):
    cfg = tiny_config(codec=codec, codec_block=64)
    group = InProcessGroup(list(CONTRIB), lambda: codec_from_config(cfg.sync))
    for got in _reduce(group, CONTRIB).values():
        assert got == pytest.approx(BY_HAND, abs=0.1)


def test_centered_clip_weighs_members_by_their_work():
    # Two agreeing members: CenteredClip with their weights lands on the weighted point.
    contrib = {"a": ([0.0, 0.0], 3.0), "b": ([4.0, 4.0], 1.0)}
    group = InProcessGroup(list(contrib), lambda: codec_from_config(tiny_config().sync),
                           Aggregator(rule="centered_clip", clip_tau=10.0))
    for got in _reduce(group, contrib).values():
        assert got == pytest.approx([1.0, 1.0], abs=1e-5)


def test_diloco_outer_step_moves_the_model_by_the_work_weighted_mean():
    # Three members from the same global weights; member i moved its local copy by d_i in a
    # window of n_i steps. Outer SGD lr 1, no momentum: new global = global - sum(n_i d_i) / sum(n_i).
    cfg = tiny_config(algorithm="diloco", outer_lr=1.0, outer_momentum=0.0, round_budget="speed")
    group = InProcessGroup(["a", "b", "c"], lambda: codec_from_config(cfg.sync))
    start = torch.tensor([1.0, -1.0, 0.5])
    moves = {
        "a": (torch.tensor([0.3, 0.0, -0.3]), 6),
        "b": (torch.tensor([-0.6, 0.6, 0.0]), 3),
        "c": (torch.tensor([0.0, 0.9, 0.9]), 1),
    }
    params = {p: nn.Parameter(start.clone()) for p in moves}
    syncs = {p: DiLoCo([("w", params[p])], cfg.sync, group.exchange(p), round_timeout_s=30) for p in moves}

    def member(p: str) -> None:
        d, n = moves[p]
        s = syncs[p]
        s.weight = float(n * 128)  # the window's tokens (n steps of 128 tokens)
        assert s.plan_window(n) == n
        for i in range(n):
            if i == n - 1:
                with torch.no_grad():
                    params[p].add_(d)  # the window's local progress, before its last step's sync
            s.after_optimizer_step(1000 + i)  # the schedule step does not set the sync point

    threads = [threading.Thread(target=member, args=(p,)) for p in moves]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # delta_i = global - local_i = -d_i; the outer step: global - mean(delta) = global + weighted mean(d)
    expected = start + (6 * moves["a"][0] + 3 * moves["b"][0] + 1 * moves["c"][0]) / 10
    for p in moves:
        assert syncs[p].outer_steps == 1
        assert params[p].detach().tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_a_window_stretches_the_fragment_schedule_to_the_members_steps():
    cfg = tiny_config(algorithm="streaming", fragments=2, inner_steps=10, overlap_steps=0)
    group = InProcessGroup(["a"], lambda: codec_from_config(cfg.sync))
    p1, p2 = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    sync = StreamingDiLoCo([("blocks.0.w", p1), ("blocks.1.w", p2)], cfg.sync, group.exchange("a"), round_timeout_s=30)
    launched: list[int] = []
    for n in (7, 3, 1):  # a long window, a short one, and one shorter than the fragments
        used = sync.plan_window(n)
        assert used == max(n, 2)
        for i in range(used):
            before = sync.outer_steps
            sync.after_optimizer_step(0)
            launched += [i] * (sync.outer_steps - before)
    # Fragment 0 after step 1*n//2, fragment 1 at the window's end (0-based: n//2 - 1 and n - 1).
    assert launched == [2, 6, 0, 2, 0, 1]


def test_a_window_is_longer_than_the_overlap_so_a_fragment_lands_before_it_launches_again():
    cfg = tiny_config(algorithm="streaming", fragments=2, inner_steps=10, overlap_steps=3)
    group = InProcessGroup(["a"], lambda: codec_from_config(cfg.sync))
    p1, p2 = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    sync = StreamingDiLoCo([("blocks.0.w", p1), ("blocks.1.w", p2)], cfg.sync, group.exchange("a"), round_timeout_s=30)
    assert sync.plan_window(2) == 4
    for _ in range(3):  # windows of the shortest length: never two rounds of one fragment in flight
        for _ in range(sync.plan_window(1)):
            sync.after_optimizer_step(0)
            keys = [f.fragment.index for f in sync.in_flight]
            assert len(keys) == len(set(keys)), keys


def test_steps_trained_while_the_round_is_in_flight_are_carried_onto_the_new_global_copy():
    # sync.fill_wait: "a" launches its window (moved by d_a), trains on while the round is in
    # flight (moves by e), then lands it: local = new global + e, not the new global (e kept).
    # "b" lands at once: local = new global exactly. Outer SGD lr 1, no momentum.
    cfg = tiny_config(algorithm="diloco", outer_lr=1.0, outer_momentum=0.0, round_budget="speed")
    group = InProcessGroup(["a", "b"], lambda: codec_from_config(cfg.sync))
    start = torch.tensor([1.0, -1.0])
    d = {"a": torch.tensor([0.4, 0.0]), "b": torch.tensor([0.0, -0.2])}
    e = torch.tensor([0.05, 0.1])
    params = {p: nn.Parameter(start.clone()) for p in d}
    syncs = {p: DiLoCo([("w", params[p])], cfg.sync, group.exchange(p), round_timeout_s=30) for p in d}
    filled: dict[str, bool] = {}

    def member(p: str) -> None:
        s = syncs[p]
        s.fill, s.weight = True, 1.0
        assert s.plan_window(2) == 2
        with torch.no_grad():
            params[p].add_(d[p])
        s.after_optimizer_step(0)
        s.after_optimizer_step(1)  # the window's last step launches; nothing waits for the round
        assert s.outer_steps == 0 and s.landing() is not None
        if p == "a":
            with torch.no_grad():
                params[p].add_(e)
            s.after_optimizer_step(2)  # a step of the next window, trained while the round is in flight
            assert s.outer_steps == 0  # the step hooks do not apply it
        filled[p] = s.landing() is not None
        s.land()

    threads = [threading.Thread(target=member, args=(p,)) for p in d]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    new_global = start + (d["a"] + d["b"]) / 2
    assert filled == {"a": True, "b": True}
    for p in d:
        assert syncs[p].outer_steps == 1 and syncs[p].landing() is None
        assert syncs[p].global_params[0].tolist() == pytest.approx(new_global.tolist(), abs=1e-6)
    assert params["a"].detach().tolist() == pytest.approx((new_global + e).tolist(), abs=1e-6)
    assert params["b"].detach().tolist() == new_global.tolist()
    # The next window's pseudo-gradient holds the carried steps: global - local = -e so far.
    syncs["a"].plan_window(1)
    assert (syncs["a"].global_params[0] - params["a"].detach()).tolist() == pytest.approx((-e).tolist(), abs=1e-6)
