"""The node's Prometheus endpoint: GET /metrics through prometheus_client, on the daemon's loop.

The training thread updates `NodeMetrics` fields; plain float/int assignments are atomic under the
GIL, and a scrape reads whatever the last round wrote (a custom collector turns the fields into
metric families at scrape time; prometheus_client renders them and escapes the label values).
The HTTP server is protocol.http_server's, shared with the coordinator.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from murmur.protocol.http_server import HttpServer, one_line_errors

MetricsServer = HttpServer  # the name the daemon knows

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# field -> (kind, help). Counters are exposed with prometheus_client's `_total` suffix.
_HELP = {
    "round": ("gauge", "outer rounds this node completed"),
    "steps": ("counter", "inner steps this node trained"),
    "loss": ("gauge", "mean training loss of the last round"),
    "tokens_per_s": ("gauge", "training tokens per second over the last round"),
    "tokens_total": ("counter", "training tokens consumed"),
    "bytes_sent_total": ("counter", "payload bytes this node sent to peers"),
    "bytes_received_total": ("counter", "payload bytes this node received from peers"),
    "compression_ratio": ("gauge", "bytes fp32 data-parallel training would have sent / bytes sent"),
    "peers": ("gauge", "members of the last exchange round"),
    "compute_seconds_total": ("counter", "seconds spent computing (forward, backward, optimizer)"),
    "exchange_wait_seconds_total": ("counter", "seconds training was blocked waiting for the exchange"),
    "wall_seconds_total": ("counter", "seconds spent in training windows"),
    "coordinator_up": ("gauge", "1 when the last coordinator call succeeded"),
    "pending_commits": ("gauge", "progress commits waiting for the coordinator"),
    "commits_total": ("counter", "progress commits the coordinator acknowledged"),
}


@dataclass(slots=True)
class NodeMetrics:
    round: int = 0
    steps: int = 0
    loss: float = float("nan")
    tokens_per_s: float = 0.0
    tokens_total: int = 0
    bytes_sent_total: int = 0
    bytes_received_total: int = 0
    compression_ratio: float = 0.0
    peers: int = 0
    compute_seconds_total: float = 0.0
    exchange_wait_seconds_total: float = 0.0
    wall_seconds_total: float = 0.0
    coordinator_up: int = 0
    pending_commits: int = 0
    commits_total: int = 0


class NodeCollector:
    def __init__(self, metrics: NodeMetrics, labels: dict[str, str]) -> None:
        self.metrics = metrics
        self.names = sorted(labels)
        self.values = [labels[k] for k in self.names]

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        for f in fields(m):
            kind, text = _HELP[f.name]
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = family(f"murmur_node_{f.name}", text, labels=self.names)
            metric.add_metric(self.values, getattr(m, f.name))
            yield metric
        # Where a round's wall time went: computing, blocked on the exchange (what overlap did not
        # hide), or the rest (data loading, leases, evaluation).
        phases = CounterMetricFamily(
            "murmur_node_round_seconds",
            "seconds of training windows by phase: compute, exchange (blocked on it), wait (data, leases, eval)",
            labels=[*self.names, "phase"],
        )
        exchange = m.exchange_wait_seconds_total
        phases.add_metric([*self.values, "compute"], m.compute_seconds_total)
        phases.add_metric([*self.values, "exchange"], exchange)
        phases.add_metric([*self.values, "wait"], max(0.0, m.wall_seconds_total - m.compute_seconds_total - exchange))
        yield phases


def metrics_server(metrics: NodeMetrics, labels: dict[str, str]) -> MetricsServer:
    """The daemon's /metrics endpoint (``start(host, port)`` returns the bound port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(metrics, labels))  # type: ignore[arg-type]  # duck-typed collector

    async def scrape(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[one_line_errors])
    app.router.add_get("/metrics", scrape)
    return HttpServer(app)
