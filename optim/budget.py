"""A round's budget for members of different speeds (docs/algorithms.md, "Volunteers of different
speeds").

``sync.round_budget = "fixed"``: every member trains H inner steps a round (the slowest one sets
the round's length; the others wait for it).

``sync.round_budget = "speed"``: the group's budget is hivemind's target batch in DiLoCo's units,
K * H inner steps a round (K members), shared in proportion to each member's measured speed:

    steps_i = H * rate_i / mean(rate_j over the round's members)

so every member needs about the same wall time, H steps at the group's mean speed, and nobody
idles behind the slowest. A member's share is clipped to [H / max_step_ratio, H * max_step_ratio]:
a very slow volunteer still does some useful work per round (and the round waits for at most that
much), a very fast one does not drift far from the global model before it syncs.

The rates are steps per second of *compute* (a window's time less its waits for the exchange and
for leases), so a fast member that waited for the others last round is not mistaken for a slow one.
Each member learns the others' rates from their DHT records (the node) or from the simulated
speeds (the simulator); the rule itself needs nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

BUDGET_RULES = ("fixed", "speed")
RATE_EMA = 0.5  # weight of the newest window in a member's rate: a speed change shows within 2-3 rounds


class BudgetError(ValueError):
    pass


def member_steps(h: int, own_rate: float, group_rates: Iterable[float], max_ratio: float) -> int:
    """This member's inner steps for the next round (``group_rates``: every member's, this one
    included; rates that are not positive and finite are unknown and left out). H while its own
    rate or the group's is unknown."""
    if h <= 0 or max_ratio < 1:
        raise BudgetError(f"need H > 0 and max_step_ratio >= 1, got H={h}, max_step_ratio={max_ratio}")
    known = [r for r in group_rates if math.isfinite(r) and r > 0]
    if not (math.isfinite(own_rate) and own_rate > 0) or not known:
        return h
    share = h * own_rate / (sum(known) / len(known))
    lo, hi = max(1.0, h / max_ratio), h * max_ratio
    return max(1, round(min(hi, max(lo, share))))


class SpeedMeter:
    """A member's compute rate (inner steps per second), an EMA over its windows."""

    def __init__(self, ema: float = RATE_EMA) -> None:
        self.ema = ema
        self.rate = 0.0  # 0: not measured yet

    def add(self, steps: int, compute_seconds: float) -> float:
        if steps <= 0 or not (compute_seconds > 0 and math.isfinite(compute_seconds)):
            return self.rate
        now = steps / compute_seconds
        self.rate = now if self.rate <= 0 else self.ema * now + (1 - self.ema) * self.rate
        return self.rate
