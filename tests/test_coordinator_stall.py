"""A stalled run looks stalled: active nodes that complete no round past the threshold (the
coordinator's stall_after_s, or 3 of the run's recent round gaps if longer) show as stalled in the
status that `murmur admin status`, /api/status and /metrics are built from, with the reason where
the ledger holds one. In process, on a hand-driven clock."""

from __future__ import annotations

import json

import pytest
from _coordinator_helpers import CONFIG, Clock

from murmur.coordinator.leases import Progress
from murmur.coordinator.membership import Membership
from murmur.coordinator.runs import Runs
from murmur.coordinator.settings import CoordinatorSettings, SettingsError
from murmur.coordinator.status_report import StatusSource
from murmur.coordinator.store import Store
from murmur.protocol import identity

STALL_S = 100.0


@pytest.fixture
def run(tmp_path):
    clock = Clock()
    settings = CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=1000, lease_ttl_s=1000,
                                   stall_after_s=STALL_S)
    store = Store(tmp_path / "c.db")
    members = Membership(store, settings, identity.CertificateAuthority.create(), clock=clock)
    runs = Runs(store, settings, "ab" * 32, clock=clock)
    run_id = runs.create(CONFIG, json.dumps({"shards": [{"id": 0, "file": "s0", "tokens": 10_000}]}))
    token = runs.create_token(run_id, 3600, 5, "").token
    status = StatusSource(store, members, runs, settings)
    yield store, members, clock, run_id, token, status
    store.close()


def _join(members, token) -> str:
    node = members.join(token, identity.make_csr(identity.generate_key()), {"device": "cpu"}, "").node_id
    members.heartbeat(node, 1.0)
    return node


def test_no_round_past_the_threshold_is_stalled_and_says_why(run):
    store, members, clock, run_id, token, status = run
    assert not status.status_reply(run_id, clock.t).stalled  # nobody active: idle, not stalled
    node = _join(members, token)
    reply = status.status_reply(run_id, clock.t + STALL_S)
    assert not reply.stalled and reply.last_round_at == 0 and reply.stall_after_s == STALL_S
    reply = status.status_reply(run_id, clock.t + STALL_S + 1)
    assert reply.stalled and "no round completed for 101s after any round with 1 active node" in reply.stall_reason
    assert "none refused" in reply.stall_reason
    with store.write():
        store.event("round_refused", run_id=run_id, node_id=node, at=clock.t + 5, round=1,
                    why="its group is not the one the run granted")
    reply = status.status_reply(run_id, clock.t + STALL_S + 1)
    assert "1 rounds refused as a split (last: its group is not the one the run granted)" in reply.stall_reason
    # The metrics read the same rule.
    (progress,) = status.progress(clock.t + STALL_S + 1)
    assert progress.stalled and progress.run.run_id == run_id


def test_a_round_ends_the_stall_and_slow_rounds_raise_the_threshold(run):
    store, members, clock, run_id, token, status = run
    node = _join(members, token)
    lease, _ = members.leases.acquire(run_id, node)
    offset = 0
    for step in range(1, 5):  # a round every 200 s: slower than stall_after_s
        clock.t += 200
        members.heartbeat(node, 1.0)
        members.leases.commit(run_id, node, lease.lease_id, lease.shard_id, offset, offset + 100,
                              Progress(outer_step=step, loss=2.0, bytes_sent=1, seconds=1.0))
        offset += 100
    reply = status.status_reply(run_id, clock.t + 10)
    assert reply.last_round_at == clock.t and reply.last_round_age_s == 10 and reply.run.outer_step == 4
    assert reply.stall_after_s == 600 and not reply.stalled  # 3 median gaps of 200 s, not 100 s
    assert status.status_reply(run_id, clock.t + 599).stalled is False
    late = status.status_reply(run_id, clock.t + 601)
    assert late.stalled and "after round 4" in late.stall_reason
    with store.write():
        store.db.execute("UPDATE runs SET state = 'paused' WHERE run_id = ?", (run_id,))
    assert not status.status_reply(run_id, clock.t + 601).stalled  # a paused run is idle by choice


def test_the_threshold_must_be_positive():
    with pytest.raises(SettingsError, match="stall_after_s"):
        CoordinatorSettings(stall_after_s=0)


def test_a_run_whose_nodes_are_all_gone_is_stopped_past_the_threshold_and_its_rates_are_zero(run):
    """0 active nodes counted as idle, not stalled: the page said `(active)` with no banner, and 27 s
    after the run's last node died it still showed its last minute's tokens/s."""
    store, members, clock, run_id, token, status = run
    node = _join(members, token)
    lease, _ = members.leases.acquire(run_id, node)
    members.leases.commit(run_id, node, lease.lease_id, lease.shard_id, 0, 500, Progress(1, 3.0, 0, 1.0))
    reply = status.status_reply(run_id, clock.t)
    assert reply.tokens_per_s > 0 and not reply.stopped
    members.leave(node, "test")  # the last node goes (lost would do the same)
    gone = clock.t
    reply = status.status_reply(run_id, gone + 1)
    assert reply.tokens_per_s == 0.0 and all(n.tokens_per_s == 0.0 for n in reply.nodes)
    assert not reply.stopped and not reply.stalled  # within the threshold
    reply = status.status_reply(run_id, gone + STALL_S + 1)
    assert reply.stopped and reply.stalled and reply.run.state == "active"
    assert reply.stall_reason.startswith("no active node for 101s") and "murmur node run" in reply.stall_reason
    (progress,) = status.progress(gone + STALL_S + 1)
    assert progress.stopped
    page = status.page_status(run_id)  # now: long after the hand-driven clock's moments
    assert page["status"]["stopped"] is True


def test_a_run_no_node_joined_yet_is_waiting_not_stopped(run):
    store, members, clock, run_id, token, status = run
    reply = status.status_reply(run_id, clock.t + 10 * STALL_S)
    assert not reply.stopped and not reply.stalled
