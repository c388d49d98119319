"""Robust aggregation: one poisoned update out of five (scaled by 1e4, or NaN) moves the plain mean
far away; trimmed mean and CenteredClip stay close to the honest mean; the pre-filter drops it."""

from __future__ import annotations

import pytest
import torch

from murmur.optim.aggregate import Aggregator, AggregatorError, centered_clip, mean, prefilter, trimmed_mean


def honest_updates(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    center = [torch.randn(20, 10, generator=gen), torch.randn(15, generator=gen)]
    ups = [[c + 0.1 * torch.randn(c.shape, generator=gen) for c in center] for _ in range(n)]
    return ups


def distance(a, b):
    return torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True))).item()


def honest_mean(ups):
    return [torch.stack([u[i] for u in ups]).mean(0) for i in range(len(ups[0]))]


@pytest.mark.parametrize("poison", ["scaled", "nan"])
def test_robust_rules_resist_one_poisoned_update_and_mean_does_not(poison):
    ups = honest_updates()
    target = honest_mean(ups)
    bad = [t * 1e4 for t in ups[0]] if poison == "scaled" else [torch.full_like(t, float("nan")) for t in ups[0]]
    all_ups = [*ups[:2], bad, *ups[2:]]
    weights = [1.0] * 5
    honest_scale = distance(ups[0], target)  # the spread of honest updates around their mean

    plain = mean(all_ups, weights)
    d_plain = distance(plain, target)
    assert not d_plain < 100 * honest_scale  # NaN or far away: the plain mean is ruined

    for agg in (trimmed_mean(all_ups, weights, trim=1), centered_clip(all_ups, weights, tau=1.0)):
        d = distance(agg, target)
        assert d < honest_scale, (d, honest_scale)


def test_prefilter_drops_non_finite_and_huge_norms():
    ups = honest_updates(4)
    nan = [torch.full_like(t, float("nan")) for t in ups[0]]
    huge = [t * 1e4 for t in ups[1]]
    kept, dropped = prefilter([*ups, nan, huge], [1.0] * 6)
    assert kept == [0, 1, 2, 3]
    assert "non-finite" in dropped[4] and "median" in dropped[5]


def test_aggregator_filters_then_aggregates_even_the_plain_mean():
    ups = honest_updates(4)
    huge = [t * 1e4 for t in ups[1]]
    agg, dropped = Aggregator(rule="mean")([*ups, huge], [1.0] * 5)
    assert list(dropped) == [4]
    assert distance(agg, honest_mean(ups)) < 1e-5


def test_weights_and_weight_zero():
    a, b = [torch.ones(3)], [torch.full((3,), 4.0)]
    torch.testing.assert_close(mean([a, b], [1.0, 2.0])[0], torch.full((3,), 3.0))
    torch.testing.assert_close(mean([a, b], [1.0, 0.0])[0], torch.ones(3))
    torch.testing.assert_close(trimmed_mean([a, b], [0.0, 1.0], trim=1)[0], torch.full((3,), 4.0))
    with pytest.raises(AggregatorError):
        mean([a, b], [0.0, 0.0])


def test_every_update_rejected_is_a_clear_error():
    nan = [torch.full((3,), float("nan"))]
    with pytest.raises(AggregatorError, match="rejected"):
        Aggregator(rule="trimmed_mean")([nan, nan], [1.0, 1.0])


def test_unknown_rule():
    with pytest.raises(AggregatorError, match="known"):
        Aggregator(rule="median")
