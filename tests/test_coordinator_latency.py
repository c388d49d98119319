"""The coordinator's latency histogram (coordinator/latency.py): buckets, a window between two
readings, percentiles read as the upper bound of their bucket, and its Prometheus rendering."""

from __future__ import annotations

import math
import re

from prometheus_client import CollectorRegistry, generate_latest

from murmur.coordinator.heartbeat_udp import HeartbeatDatagrams
from murmur.coordinator.latency import Histogram, quantile, since
from murmur.coordinator.metrics import LedgerCollector


def test_observations_fall_in_their_buckets_and_a_percentile_is_its_buckets_upper_bound():
    h = Histogram((0.001, 0.01, 0.1))
    for seconds in [0.0005] * 90 + [0.005] * 9 + [0.05]:
        h.observe(seconds)
    assert h.count == 100 and math.isclose(h.sum, 0.045 + 0.045 + 0.05)
    assert h.cumulative() == [(0.001, 90), (0.01, 99), (0.1, 100), (math.inf, 100)]
    assert quantile(h.cumulative(), 0.5) == 0.001
    assert quantile(h.cumulative(), 0.99) == 0.01  # the 99th of 100 is the last of the 10 ms bucket
    assert quantile(h.cumulative(), 1.0) == 0.1
    h.observe(7.0)  # beyond the last bound: +Inf
    assert quantile(h.cumulative(), 1.0) == math.inf
    h.observe(0.001)  # a bound belongs to its own bucket (le: less or equal)
    assert h.cumulative()[0] == (0.001, 91)
    assert math.isnan(quantile(Histogram().cumulative(), 0.99))


def test_a_window_is_the_difference_of_two_readings():
    h = Histogram((0.001, 0.01))
    for _ in range(50):
        h.observe(0.02)  # before the window: slow
    before = h.cumulative()
    for _ in range(10):
        h.observe(0.0001)
    window = since(h.cumulative(), before)
    assert window == [(0.001, 10), (0.01, 10), (math.inf, 10)]
    assert quantile(window, 0.99) == 0.001  # the slow beats before it are not in it


def test_the_datagram_endpoints_histogram_is_on_metrics_with_prometheus_buckets():
    datagrams = HeartbeatDatagrams(lambda node, request: None)  # type: ignore[arg-type,return-value]
    for seconds in (0.0003, 0.004, 0.004, 3.0):
        datagrams.latency.observe(seconds)

    class Nothing(LedgerCollector):  # the datagram part alone: no ledger needed for it
        def collect(self):
            yield from self._datagrams()

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Nothing(None, None, lambda: 0, lambda _: None, datagrams=lambda: datagrams))  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    series = dict(re.findall(r"^murmur_heartbeat_datagram_seconds_(\S+) (\S+)$", text, re.M))
    assert float(series["count"]) == 4 and math.isclose(float(series["sum"]), 3.0083)
    assert float(series['bucket{le="0.0005"}']) == 1 and float(series['bucket{le="0.005"}']) == 3
    assert float(series['bucket{le="2.5"}']) == 3 and float(series['bucket{le="+Inf"}']) == 4
