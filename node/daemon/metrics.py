"""The node's Prometheus endpoint: a few gauges and counters as text on GET /metrics.

Served by protocol.metrics_http on the daemon's asyncio loop (shared with the coordinator).
The training thread updates `NodeMetrics` fields; plain float/int assignments are atomic under the
GIL, and a scrape reads whatever the last round wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from murmur.protocol.metrics_http import MetricsServer

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
    wall_seconds_total: float = 0.0
    coordinator_up: int = 0
    pending_commits: int = 0
    commits_total: int = 0

    def render(self, labels: dict[str, str]) -> str:
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        lines = []
        for f in fields(self):
            kind, text = _HELP[f.name]
            name = f"murmur_node_{f.name}"
            lines += [
                f"# HELP {name} {text}",
                f"# TYPE {name} {kind}",
                f"{name}{{{lab}}} {getattr(self, f.name)}",
            ]
        return "\n".join(lines) + "\n"


def metrics_server(metrics: NodeMetrics, labels: dict[str, str]) -> MetricsServer:
    """The daemon's /metrics endpoint, rendering ``metrics`` at each scrape."""
    return MetricsServer(lambda: metrics.render(labels))
