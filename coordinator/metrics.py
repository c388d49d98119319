"""The coordinator's Prometheus metrics, rendered for protocol.metrics_http's GET /metrics server.

Values are read from the ledger at scrape time (a few aggregate queries), so they are exact and
survive restarts; per-method call counts are this process's own.
"""

from __future__ import annotations

from collections.abc import Callable

from murmur.protocol.metrics_http import MetricsServer

from .service import Stats
from .store import Store

__all__ = ["MetricsServer", "render"]  # the server is protocol's, shared with the node


def render(store: Store, stats: Stats, pending_heartbeats: Callable[[], int]) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

    by_status = {s: 0 for s in ("active", "lost", "left", "banned")}
    by_status.update(store.nodes_by_status())
    metric(
        "murmur_nodes",
        "gauge",
        "Nodes by status.",
        [(f'{{status="{s}"}}', n) for s, n in sorted(by_status.items())],
    )
    counters = store.counters()
    metric(
        "murmur_tokens_committed_total",
        "counter",
        "Dataset tokens committed (each counted once).",
        [("", counters.get("tokens_committed", 0))],
    )
    metric("murmur_commits_total", "counter", "Progress commits accepted.", [("", counters.get("commits", 0))])
    metric(
        "murmur_commits_refused_total",
        "counter",
        "Commits refused because the lease was lost.",
        [("", counters.get("commits_refused", 0))],
    )
    rounds = store.db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0]
    metric("murmur_rounds_total", "counter", "Outer steps with at least one commit.", [("", rounds)])
    metric(
        "murmur_lease_churn_total",
        "counter",
        "Leases granted, released and expired.",
        [
            ('{kind="granted"}', counters.get("leases_granted", 0)),
            ('{kind="released"}', counters.get("leases_released", 0)),
            ('{kind="expired"}', counters.get("leases_expired", 0)),
        ],
    )
    held = store.db.execute("SELECT COUNT(*) FROM shards WHERE lease_id IS NOT NULL").fetchone()[0]
    metric("murmur_leases_held", "gauge", "Shards leased right now.", [("", held)])
    metric(
        "murmur_ban_list_version",
        "gauge",
        "Changes to the ban list so far.",
        [("", counters.get("ban_version", 0))],
    )
    metric(
        "murmur_heartbeats_pending",
        "gauge",
        "Heartbeats received and not yet flushed to the ledger.",
        [("", pending_heartbeats())],
    )
    metric(
        "murmur_rpc_calls_total",
        "counter",
        "RPCs handled, by method.",
        [(f'{{method="{m}"}}', n) for m, n in sorted(stats.calls.items())],
    )
    metric(
        "murmur_rpc_errors_total",
        "counter",
        "RPCs answered with an error, by method.",
        [(f'{{method="{m}"}}', n) for m, n in sorted(stats.errors.items())],
    )
    return "\n".join(lines) + "\n"
