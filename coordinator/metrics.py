"""The coordinator's Prometheus metrics, through prometheus_client (which also escapes label values).

Ledger values are read at scrape time by a custom collector (a few aggregate queries in store.py),
so they are exact and survive restarts; per-method call counts are this process's own. The HTTP
side is coordinator/status/http.py, which serves ``exposition()`` on GET /metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from murmur.protocol.coordinator_pb2 import StatusReply

from .group_commit import GroupCommit
from .heartbeat_udp import DROP_REASONS, HeartbeatDatagrams
from .runs import sync_of
from .service import Stats
from .store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client's text format
STATUSES = ("active", "lost", "left", "banned")
LEASE_CHURN = (("granted", "leases_granted"), ("released", "leases_released"), ("expired", "leases_expired"))


class LedgerCollector:
    """Yields every coordinator metric, read from the ledger (and the in-memory call counts)."""

    def __init__(self, store: Store, stats: Stats, pending_heartbeats: Callable[[], int],
                 tokens_per_s: Callable[[str], float | None],
                 progress: Callable[[], list[StatusReply]] | None = None,
                 datagrams: Callable[[], HeartbeatDatagrams | None] | None = None,
                 group: GroupCommit | None = None) -> None:
        self.store = store
        self.stats = stats
        self.pending_heartbeats = pending_heartbeats
        self.tokens_per_s = tokens_per_s  # the live figure from heartbeats not yet flushed
        self.progress = progress  # each run's round, last round and stall (status_report.py)
        self.datagrams = datagrams  # the heartbeat datagram endpoint, once (and if) it serves
        self.group = group  # the group commits of joins, lease grants and commits

    def collect(self) -> Iterator[Metric]:
        counters = self.store.counters()
        nodes = GaugeMetricFamily("murmur_nodes", "Nodes by status.", labels=["status"])
        by_status = dict.fromkeys(STATUSES, 0) | self.store.nodes_by_status()
        for status, n in sorted(by_status.items()):
            nodes.add_metric([status], n)
        yield nodes

        def counter(name: str, help_text: str, key: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, help_text, value=counters.get(key, 0))

        yield counter("murmur_tokens_committed", "Dataset tokens committed (each counted once).", "tokens_committed")
        yield counter("murmur_commits", "Progress commits accepted.", "commits")
        yield counter("murmur_commits_refused", "Commits refused because the lease was lost.", "commits_refused")
        yield CounterMetricFamily(
            "murmur_rounds", "Outer steps with at least one commit.", value=self.store.rounds_total()
        )
        churn = CounterMetricFamily("murmur_lease_churn", "Leases granted, released and expired.", labels=["kind"])
        for kind, key in LEASE_CHURN:
            churn.add_metric([kind], counters.get(key, 0))
        yield churn
        yield GaugeMetricFamily("murmur_leases_held", "Shards leased right now.", value=self.store.leases_held())
        yield GaugeMetricFamily(
            "murmur_ban_list_version", "Changes to the ban list so far.", value=counters.get("ban_version", 0)
        )
        yield GaugeMetricFamily(
            "murmur_heartbeats_pending",
            "Heartbeats received and not yet flushed to the ledger.",
            value=self.pending_heartbeats(),
        )
        yield from self._per_run()
        yield from self._per_node()
        calls = CounterMetricFamily("murmur_rpc_calls", "RPCs handled, by method.", labels=["method"])
        errors = CounterMetricFamily("murmur_rpc_errors", "RPCs answered with an error, by method.", labels=["method"])
        for method, n in sorted(self.stats.calls.items()):
            calls.add_metric([method], n)
        for method, n in sorted(self.stats.errors.items()):
            errors.add_metric([method], n)
        yield calls
        yield errors
        if self.group is not None:  # calls over batches: the mean batch, one fsync each
            yield CounterMetricFamily("murmur_group_commit_batches", "Group-commit transactions (one fsync each).",
                                      value=self.group.batches)
            yield CounterMetricFamily("murmur_group_commit_calls", "Calls answered through group commits "
                                      "(joins, lease grants, commits).", value=self.group.calls)
        yield from self._datagrams()

    def _datagrams(self) -> Iterator[Metric]:
        d = self.datagrams() if self.datagrams is not None else None
        if d is None:
            return
        answered = CounterMetricFamily("murmur_heartbeat_datagrams", "Heartbeat datagrams answered, by outcome "
                                       "(served; use_grpc: refused or too large for a datagram).", labels=["outcome"])
        answered.add_metric(["served"], d.served)
        for why, n in sorted(d.use_grpc.items()):
            answered.add_metric([f"use_grpc_{why}"], n)
        yield answered
        dropped = CounterMetricFamily("murmur_heartbeat_datagrams_dropped", "Heartbeat datagrams dropped unanswered, "
                                      "by reason.", labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], d.dropped[reason])
        yield dropped
        latency = HistogramMetricFamily(
            "murmur_heartbeat_datagram_seconds", "Heartbeat datagrams answered: from arrival at the coordinator's "
            "socket (the kernel's timestamp) to the reply sent.")
        latency.add_metric([], [(_le(b), n) for b, n in d.latency.cumulative()], sum_value=d.latency.sum)
        yield latency

    def _per_run(self) -> Iterator[Metric]:
        sent = CounterMetricFamily(
            "murmur_bytes_sent", "Payload bytes nodes reported sending, by run and update codec.",
            labels=["run", "codec"],
        )
        for row in self.store.bytes_sent_by_run():
            sent.add_metric([row["run_id"], str(sync_of(row["config_toml"])["codec"])], row["bytes_sent"])
        yield sent
        if self.progress is None:
            return
        step = GaugeMetricFamily("murmur_run_round", "The run's newest completed round (outer step).", labels=["run"])
        age = GaugeMetricFamily("murmur_run_seconds_since_round",
                                "Seconds since the run's newest round completed (absent before the first).",
                                labels=["run"])
        val = GaugeMetricFamily("murmur_run_val_loss",
                                "The validation loss of the newest round a node evaluated (absent before one).",
                                labels=["run"])
        stalled = GaugeMetricFamily("murmur_run_stalled",
                                    "1 while active nodes have completed no round for the stall threshold, "
                                    "or the run has had no active node for it (stopped).",
                                    labels=["run"])
        stopped = GaugeMetricFamily("murmur_run_stopped",
                                    "1 while an active run has had no active node for the stall threshold.",
                                    labels=["run"])
        for reply in self.progress():
            run = [reply.run.run_id]
            step.add_metric(run, reply.run.outer_step)
            if reply.last_round_at:
                age.add_metric(run, reply.last_round_age_s)
            stalled.add_metric(run, int(reply.stalled))
            stopped.add_metric(run, int(reply.stopped))
            if (v := self.store.last_val_loss(reply.run.run_id)) is not None:
                val.add_metric(run, v)
        yield step
        yield age
        yield val
        yield stalled
        yield stopped

    def _per_node(self) -> Iterator[Metric]:
        tps = GaugeMetricFamily(
            "murmur_node_tokens_per_s", "Training tokens per second an active node last reported.",
            labels=["run", "node"],
        )
        sent = CounterMetricFamily(
            "murmur_node_bytes_sent", "Payload bytes a node's commits reported.", labels=["run", "node"]
        )
        refused = CounterMetricFamily(
            "murmur_node_commits_refused", "A node's commits refused because its lease was lost.",
            labels=["run", "node"],
        )
        for row in self.store.node_summaries():
            labels = [row["run_id"], row["node_id"]]
            if row["status"] == "active":
                tps.add_metric(labels, self.tokens_per_s(row["node_id"]) or row["tokens_per_s"])
            sent.add_metric(labels, row["bytes_sent"])
            refused.add_metric(labels, row["commits_refused"])
        yield tps
        yield sent
        yield refused


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def registry(collector: LedgerCollector) -> CollectorRegistry:
    """A registry of our own (not the process-wide default, which tests would share)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)  # type: ignore[arg-type]  # a duck-typed collector, as the library documents
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
