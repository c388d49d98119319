"""Aggregation rules for a round's updates, and the cheap pre-filter in front of them.

Every rule takes the members' decoded updates in sorted peer order (a list of tensor lists,
one list per member, the same shapes in each) and returns one tensor list. The order is fixed by
the caller, so every peer that aggregates the same inputs gets bit-identical results.

- ``mean``: the weighted mean. One poisoned update moves it arbitrarily far.
- ``trimmed_mean``: per coordinate, drop the ``trim`` largest and smallest values and average
  the rest (weights only decide who takes part: weight-0 members are left out).
- ``centered_clip``: Karimireddy et al.; starts at the coordinate-wise median and pulls towards
  each update with its pull clipped to radius tau, over the whole update vector. ``clip_tau`` is
  relative: tau = clip_tau * the median distance of the updates from the starting point, so one
  setting fits updates of any scale.

`prefilter` runs before any rule: it drops updates with NaN/Inf and those whose norm is more
than ``norm_factor`` times the round's median norm.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from murmur.errors import MurmurError

AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")
NORM_FILTER_FACTOR = 10.0  # an update this many times the median norm is dropped
CENTERED_CLIP_ITERS = 20


class AggregatorError(MurmurError):
    pass


Updates = Sequence[Sequence[torch.Tensor]]


def _flat(update: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in update])


def _unflat(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for t in like:
        out.append(vec[pos : pos + t.numel()].view(t.shape))
        pos += t.numel()
    return out


def prefilter(
    updates: Updates, weights: Sequence[float], norm_factor: float = NORM_FILTER_FACTOR
) -> tuple[list[int], dict[int, str]]:
    """Indices kept, and index -> reason for those dropped."""
    norms = [torch.sqrt(sum((t.float() ** 2).sum() for t in u)).item() if u else 0.0 for u in updates]
    dropped: dict[int, str] = {}
    finite = []
    for i, n in enumerate(norms):
        if n != n or n == float("inf"):
            dropped[i] = "non-finite update"
        else:
            finite.append(i)
    live = [norms[i] for i in finite if weights[i] > 0]
    if len(live) >= 3:  # a median of one or two says nothing about what is normal
        median = statistics.median(live)
        for i in finite:
            if median > 0 and norms[i] > norm_factor * median:
                dropped[i] = f"norm {norms[i]:.3g} is over {norm_factor:g}x the round's median {median:.3g}"
    return [i for i in range(len(updates)) if i not in dropped], dropped


def mean(updates: Updates, weights: Sequence[float]) -> list[torch.Tensor]:
    total = float(sum(weights))
    if total <= 0:
        raise AggregatorError("no member with a positive weight in the round")
    out = [torch.zeros_like(t, dtype=torch.float32) for t in updates[0]]
    for u, w in zip(updates, weights, strict=True):  # fixed order: sorted peers
        if w == 0:
            continue
        for acc, t in zip(out, u, strict=True):
            acc.add_(t.float(), alpha=w / total)
    return out


def trimmed_mean(updates: Updates, weights: Sequence[float], trim: int) -> list[torch.Tensor]:
    live = [u for u, w in zip(updates, weights, strict=True) if w > 0]
    if not live:
        raise AggregatorError("no member with a positive weight in the round")
    n = len(live)
    b = min(trim, (n - 1) // 2)  # keep at least one value per coordinate
    out = []
    for i in range(len(live[0])):
        stacked = torch.stack([u[i].float() for u in live])
        # NaN sorts last, so a NaN update is trimmed like a huge one.
        s = stacked.sort(dim=0).values
        out.append(s[b : n - b].mean(dim=0))
    return out


def centered_clip(
    updates: Updates, weights: Sequence[float], tau: float, iters: int = CENTERED_CLIP_ITERS
) -> list[torch.Tensor]:
    rows = [(_flat(u), w) for u, w in zip(updates, weights, strict=True) if w > 0]
    rows = [(x, w) for x, w in rows if torch.isfinite(x).all()]
    if not rows:
        raise AggregatorError("no finite update with a positive weight in the round")
    x = torch.stack([r[0] for r in rows])
    w = torch.tensor([r[1] for r in rows], dtype=torch.float32, device=x.device)
    w = w / w.sum()
    v = x.median(dim=0).values if len(rows) > 2 else (x * w[:, None]).sum(0)
    dist = (x - v).norm(dim=1)
    radius = tau * dist.median().item()
    if radius > 0:
        for _ in range(iters):
            diff = x - v
            norms = diff.norm(dim=1).clamp_min(1e-30)
            scale = torch.clamp(radius / norms, max=1.0)
            v = v + ((w * scale)[:, None] * diff).sum(0)
    return _unflat(v, updates[0])


@dataclass(kw_only=True, slots=True)
class Aggregator:
    rule: str = "mean"
    trim: int = 1
    clip_tau: float = 1.0
    norm_factor: float = NORM_FILTER_FACTOR
    filter: bool = True

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATORS:
            raise AggregatorError(f"unknown aggregator {self.rule!r}; known: {', '.join(AGGREGATORS)}")

    def __call__(
        self, updates: Updates, weights: Sequence[float]
    ) -> tuple[list[torch.Tensor], dict[int, str]]:
        """The aggregate and index -> reason for each member left out by the pre-filter."""
        kept, dropped = list(range(len(updates))), {}
        if self.filter:
            kept, dropped = prefilter(updates, weights, self.norm_factor)
        ups, ws = [updates[i] for i in kept], [weights[i] for i in kept]
        if not ups:
            raise AggregatorError("every update of the round was rejected: " + "; ".join(dropped.values()))
        if self.rule == "mean":
            return mean(ups, ws), dropped
        if self.rule == "trimmed_mean":
            return trimmed_mean(ups, ws, self.trim), dropped
        return centered_clip(ups, ws, self.clip_tau), dropped


def aggregator_from_config(sync) -> Aggregator:  # sync: protocol.runconfig.SyncSection
    return Aggregator(rule=sync.aggregator, trim=sync.trim, clip_tau=sync.clip_tau)
