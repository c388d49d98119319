"""The node's Prometheus endpoint: a few gauges and counters as text on GET /metrics.

A tiny HTTP/1.0 server on the daemon's asyncio loop (no extra dependency, nothing to configure).
The training thread updates `NodeMetrics` fields; plain float/int assignments are atomic under the
GIL, and a scrape reads whatever the last round wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, fields

METRICS_READ_TIMEOUT_S = 5.0  # a scraper that does not send its request within this is dropped

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


class MetricsServer:
    def __init__(self, metrics: NodeMetrics, labels: dict[str, str]) -> None:
        self.metrics, self.labels = metrics, labels
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), METRICS_READ_TIMEOUT_S)
            parts = line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body, status = self.metrics.render(self.labels).encode(), "200 OK"
            else:
                body, status = b"not found: try /metrics\n", "404 Not Found"
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
