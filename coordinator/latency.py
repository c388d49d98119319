"""A latency histogram of the coordinator's own: fixed buckets, cheap enough for every heartbeat.

The load benchmark's latencies are measured at the clients, so they hold the network and the
clients' own loops besides the coordinator. This is the coordinator's part: the heartbeat datagram
endpoint (coordinator/heartbeat_udp.py) observes, for each beat it answers, the time from the
datagram's arrival at its socket (the kernel's timestamp, so the wait in the receive buffer while
the loop was busy elsewhere counts) to its reply handed back to the kernel. Exposed on /metrics as
the Prometheus histogram ``murmur_heartbeat_datagram_seconds`` (coordinator/metrics.py); two
scrapes give a window's histogram (``since``), and ``quantile`` reads a percentile off it: the
upper bound of the bucket it falls in, so an estimate that never flatters.
"""

from __future__ import annotations

import bisect
import math

# Upper bounds in seconds: fine below the 50 ms target, coarse above it (a stall of seconds is a
# stall, its exact length matters less).
BOUNDS: tuple[float, ...] = (
    0.0001, 0.0002, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
    0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations at or below it)], +Inf last: Prometheus's buckets."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


def since(after: list[tuple[float, int]], before: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The cumulative buckets of what was observed between two readings of the same histogram."""
    was = dict(before)
    return [(bound, n - was.get(bound, 0)) for bound, n in after]


def quantile(buckets: list[tuple[float, int]], q: float) -> float:
    """The upper bound of the bucket holding the q-th quantile (math.inf past the last bound;
    math.nan with no observations)."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return math.nan
    rank = q * total
    for bound, n in buckets:
        if n >= rank:
            return bound
    return math.inf
