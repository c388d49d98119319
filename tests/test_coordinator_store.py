"""The ledger and its rules in process, with a hand-driven clock: migrations, leases, accounting."""

from __future__ import annotations

import json
import sqlite3

import pytest
from _coordinator_helpers import CONFIG, Clock

from murmur.coordinator import store as store_mod
from murmur.coordinator.leases import BadCommit, LeaseLost, Progress
from murmur.coordinator.membership import JoinRefused, Membership, MembershipError
from murmur.coordinator.runs import RunError, Runs, parse_manifest
from murmur.coordinator.settings import CoordinatorSettings, SettingsError
from murmur.coordinator.store import SCHEMA_VERSION, Store, StoreError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.jointoken import JoinToken
from murmur.protocol.lease_status import LeaseAction
from murmur.protocol.lease_status import action as lease_action


def manifest(*tokens: int) -> str:
    return json.dumps({"shards": [{"id": i, "file": f"s{i}", "tokens": n} for i, n in enumerate(tokens)]})


@pytest.fixture
def ledger(tmp_path):
    clock = Clock()
    settings = CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=5, lease_ttl_s=5)
    store = Store(tmp_path / "c.db")
    ca = identity.CertificateAuthority.create()
    members = Membership(store, settings, ca, clock=clock)
    runs = Runs(store, settings, "ab" * 32, clock=clock)
    run_id = runs.create(CONFIG, manifest(1000, 300))
    token = runs.create_token(run_id, 3600, 5, "").token
    yield store, members, runs, clock, run_id, token
    store.close()


def join(members, token):
    key = identity.generate_key()
    return members.join(token, identity.make_csr(key), {"device": "cpu"}, "").node_id


def test_fresh_db_is_at_newest_schema_and_older_is_migrated(tmp_path):
    old = Store(tmp_path / "old.db", migrate_to=1)
    assert old.schema_version() == 1
    old.db.execute("INSERT INTO runs VALUES ('r', 'r', '', '{}', 'active', 0)")
    old.close()
    new = Store(tmp_path / "old.db")
    assert new.schema_version() == SCHEMA_VERSION and new.migrated_from == 1
    assert new.run("r") is not None  # data kept
    assert new.checkpoints("r") == []  # the v2 table exists
    new.close()


def test_unknown_schema_and_foreign_files_are_refused(tmp_path):
    s = Store(tmp_path / "c.db")
    s.db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    s.close()
    with pytest.raises(StoreError, match="newer than this murmur knows"):
        Store(tmp_path / "c.db")
    other = sqlite3.connect(tmp_path / "other.db")
    other.execute("CREATE TABLE t (x)")
    other.commit()
    other.close()
    with pytest.raises(StoreError, match="not a murmur ledger"):
        Store(tmp_path / "other.db")
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a usable murmur database"):
        Store(tmp_path / "junk.db")


def test_settings_reject_inconsistent_timeouts():
    with pytest.raises(SettingsError, match="heartbeat_ttl_s"):
        CoordinatorSettings(heartbeat_interval_s=5, heartbeat_ttl_s=1)
    # a TTL of one interval expires between two on-time heartbeats whenever one is a little late
    with pytest.raises(SettingsError, match="lease_ttl_s .* twice"):
        CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=3, lease_ttl_s=1)
    with pytest.raises(SettingsError, match="heartbeat_ttl_s .* twice"):
        CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=1.5)
    CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=2, lease_ttl_s=2)
    with pytest.raises(SettingsError, match="must be positive"):
        CoordinatorSettings(lease_ttl_s=0)


def test_manifest_and_config_errors_name_the_problem(ledger):
    store, _, runs, *_ = ledger
    before = store.runs()
    with pytest.raises(RunError, match="not valid JSON"):
        runs.create(CONFIG, "{", "x1")
    with pytest.raises(RunError, match="'tokens' must be"):
        parse_manifest(json.dumps({"shards": [{"id": 0, "tokens": -1}]}))
    with pytest.raises(RunError, match="repeats a shard id"):
        parse_manifest(json.dumps({"shards": [{"id": 0, "tokens": 1}, {"id": 0, "tokens": 2}]}))
    with pytest.raises(RunError, match="unknown key 'model.presett'"):
        runs.create('[model]\npresett = "tiny"\n', manifest(10), "x2")
    with pytest.raises(RunError, match="not valid TOML"):
        runs.create("name = ", manifest(10), "x3")
    assert [r["run_id"] for r in store.runs()] == [r["run_id"] for r in before]


def test_tokens_expire_run_out_and_revoke(ledger):
    store, members, runs, clock, run_id, token = ledger
    one = runs.create_token(run_id, 10, 1, "")
    join(members, one.token)
    with pytest.raises(JoinRefused, match="used up"):
        join(members, one.token)
    short = runs.create_token(run_id, 10, 3, "")
    clock.t += 11
    with pytest.raises(JoinRefused, match="expired"):
        join(members, short.token)
    runs.revoke_token(JoinToken.parse(token).token_id)
    with pytest.raises(JoinRefused, match="revoked"):
        join(members, token)
    forged = JoinToken(JoinToken.parse(token).token_id, "x" * 32, "ab" * 32)
    with pytest.raises(JoinRefused, match="not valid"):
        join(members, str(forged))


def test_lease_commit_expire_and_exact_accounting(ledger):
    store, members, runs, clock, run_id, token = ledger
    a, b = join(members, token), join(members, token)
    members.heartbeat(a, 1.0)  # started: the TTL alone decides from now on (no join grace)
    leases = members.leases
    sa, _ = leases.acquire(run_id, a)
    assert sa is not None and sa.committed_offset == 0
    assert leases.acquire(run_id, a)[0].lease_id == sa.lease_id  # idempotent: one lease per node
    p = Progress(outer_step=1, loss=2.0, bytes_sent=10, seconds=1.0)
    assert leases.commit(run_id, a, sa.lease_id, sa.shard_id, 0, 400, p).committed_offset == 400
    assert leases.commit(run_id, a, sa.lease_id, sa.shard_id, 0, 400, p).duplicate  # a retry
    with pytest.raises(BadCommit, match="committed up to 400"):
        leases.commit(run_id, a, sa.lease_id, sa.shard_id, 100, 500, p)
    with pytest.raises(BadCommit, match="finite"):
        leases.commit(run_id, a, sa.lease_id, sa.shard_id, 400, 500, Progress(1, float("nan"), 0, 0))
    # a goes silent; b keeps heartbeating. After the TTL, a is lost and its shard goes back.
    for _ in range(7):
        clock.t += 1
        members.heartbeat(b, 1.0)
        members.sweep()
    assert store.node(a)["status"] == "lost"
    shard = store.shard(run_id, sa.shard_id)
    assert shard.holder is None and shard.committed_offset == 400
    sb, _ = leases.acquire(run_id, b)
    assert (sb.shard_id, sb.committed_offset) == (sa.shard_id, 400)  # interrupted shards are resumed first
    # a's late commit of the span b now owns is refused; b's counts.
    members.member(a)  # a calls again: it is welcomed back as a member, its lease is not
    assert store.node(a)["status"] == "active"
    with pytest.raises(LeaseLost, match="no longer yours"):
        leases.commit(run_id, a, sa.lease_id, sa.shard_id, 400, 600, p)
    leases.commit(run_id, b, sb.lease_id, sb.shard_id, 400, 1000, p)
    assert store.shard(run_id, sa.shard_id).done and store.shard(run_id, sa.shard_id).holder is None
    assert store.run_totals(run_id)["tokens_committed"] == 1000
    assert sum(c["end_offset"] - c["start_offset"] for c in store.commits_of_shard(run_id, 0)) == 1000
    assert store.check_consistency() == []


def _recounted(path, run_id: str) -> dict[str, int]:
    """The run's totals counted afresh over its shards, by another reader of the ledger."""
    other = Store(path)
    try:
        other._totals.clear()
        return other.run_totals(run_id)
    finally:
        other.close()


def test_the_run_totals_kept_in_step_with_commits_equal_a_recount_through_refusals_and_rollbacks(ledger, tmp_path):
    """Every commit's reply carries the run's committed tokens: kept in step with the writes to
    the shards, not counted over them (1.4 ms a commit at 10,000 shards). A refused commit (its
    savepoint rolled back) and a rolled-back transaction leave them exact."""
    store, members, runs, clock, run_id, token = ledger
    a, b = join(members, token), join(members, token)
    leases = members.leases
    fresh = {"shards_total": 2, "shards_done": 0, "tokens_total": 1300, "tokens_committed": 0}
    assert store.run_totals(run_id) == fresh
    sa, _ = leases.acquire(run_id, a)
    sb, _ = leases.acquire(run_id, b)
    p = Progress(outer_step=1, loss=2.0, bytes_sent=10, seconds=1.0)
    with store.write():
        leases.commit(run_id, a, sa.lease_id, sa.shard_id, 0, 100, p)
        with pytest.raises(BadCommit):  # refused inside the same transaction: its savepoint rolls back
            with store.write():
                leases.commit(run_id, b, sb.lease_id, sb.shard_id, 50, 100, p)
        leases.commit(run_id, b, sb.lease_id, sb.shard_id, 0, 300, p)  # b's whole shard: done
    assert store.run_totals(run_id) == _recounted(tmp_path / "c.db", run_id)
    assert store.run_totals(run_id)["tokens_committed"] == 400 and store.run_totals(run_id)["shards_done"] == 1
    with pytest.raises(RuntimeError), store.write():  # a transaction that fails after its commit
        leases.commit(run_id, a, sa.lease_id, sa.shard_id, 100, 200, p)
        assert store.run_totals(run_id)["tokens_committed"] == 500  # inside it: its own write seen
        raise RuntimeError("the disk is full")
    assert store.run_totals(run_id) == _recounted(tmp_path / "c.db", run_id)
    assert store.run_totals(run_id)["tokens_committed"] == 400


def test_a_starting_node_has_the_join_grace_for_its_next_heartbeat_then_the_ttl(ledger):
    """A node starts its peer server and DHT between its join (or a restart's "starting"
    heartbeat) and its next heartbeat: it is not lost for that (every testnet node was, 3 s after
    it joined); one that never heartbeats is, at the grace's end; once it heartbeated, the TTL
    alone decides."""
    store, members, _runs, clock, run_id, token = ledger
    grace = members.settings.join_grace_s
    assert grace > members.settings.heartbeat_ttl_s
    starting, silent = join(members, token), join(members, token)
    clock.t += grace - 1
    assert members.sweep()[0] == []
    assert store.node(starting)["status"] == store.node(silent)["status"] == "active"
    members.heartbeat(starting, 1.0)
    clock.t += 2
    assert members.sweep()[0] == [silent]  # its grace ran out with no heartbeat
    clock.t += members.settings.heartbeat_ttl_s
    assert members.sweep()[0] == [starting]  # it heartbeated once, then went silent for a TTL
    assert store.node(starting)["status"] == store.node(silent)["status"] == "lost"
    # A restart: its first call says it is starting (it opens its DHT next), with its new
    # incarnation and no peer address yet: welcomed back, the grace again, not the TTL, until its
    # next heartbeat, and its previous process no longer listed as a live trainer.
    members.heartbeat(starting, 0.0, ("old", "127.0.0.1:1", 3, "ab"))
    assert [n for n, _ in members.live_trainers(run_id)] == [starting]
    members.heartbeat(starting, 0.0, ("new", "", -1, ""), starting=True)
    assert store.node(starting)["status"] == "active"
    assert members.live_trainers(run_id) == []
    clock.t += grace - 1
    assert members.sweep()[0] == []
    members.heartbeat(starting, 1.0)
    clock.t += members.settings.heartbeat_ttl_s + 1
    assert members.sweep()[0] == [starting]


def test_ban_releases_leases_and_refuses_the_node(ledger):
    store, members, runs, clock, run_id, token = ledger
    a = join(members, token)
    shard, _ = members.leases.acquire(run_id, a)
    members.ban(a, "poisoned updates")
    assert store.shard(run_id, shard.shard_id).holder is None
    with pytest.raises(MembershipError, match="banned"):
        members.heartbeat(a, 0.0)
    assert members.ban_list() == (1, [a])
    members.unban(a)
    assert members.ban_list() == (2, [])
    with pytest.raises(MembershipError, match="join again"):
        members.heartbeat(a, 0.0)


def test_paused_run_hands_out_no_lease(ledger):
    store, members, runs, clock, run_id, token = ledger
    a = join(members, token)
    runs.set_state(run_id, "paused")
    shard, why = members.leases.acquire(run_id, a)
    assert shard is None and "paused" in why
    runs.set_state(run_id, "active")
    assert members.leases.acquire(run_id, a)[0] is not None


def test_store_module_keeps_sql_in_one_place():
    assert store_mod.MIGRATIONS and SCHEMA_VERSION == len(store_mod.MIGRATIONS)


def test_a_rounds_validation_loss_is_the_mean_of_those_reported(ledger):
    store, members, runs, clock, run_id, token = ledger
    a = join(members, token)
    members.heartbeat(a, 1.0)
    lease, _ = members.leases.acquire(run_id, a)
    commit = members.leases.commit
    commit(run_id, a, lease.lease_id, lease.shard_id, 0, 100, Progress(1, 3.0, 0, 1.0, val_loss=2.5))
    commit(run_id, a, lease.lease_id, lease.shard_id, 100, 200, Progress(1, 3.0, 0, 1.0, val_loss=2.7))
    commit(run_id, a, lease.lease_id, lease.shard_id, 200, 300, Progress(2, 2.9, 0, 1.0))  # not evaluated
    with pytest.raises(BadCommit, match="val_loss must be a finite"):
        commit(run_id, a, lease.lease_id, lease.shard_id, 300, 400, Progress(3, 2.9, 0, 1.0, val_loss=float("inf")))
    history = [(r["outer_step"], r["val_loss"]) for r in store.round_history(run_id)]
    assert history == [(1, pytest.approx(2.6)), (2, None)]


def test_a_pipelined_run_leases_to_at_most_its_wanted_drivers(tmp_path):
    """`pipeline.drivers`: how the coordinator decides a `murmur node run --role auto` volunteer's
    role (node/daemon/pipeline_role.py): a lease makes a driver, a refusal a stage peer."""
    clock = Clock()
    settings = CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=5, lease_ttl_s=5)
    store = Store(tmp_path / "c.db")
    try:
        members = Membership(store, settings, identity.CertificateAuthority.create(), clock=clock)
        runs = Runs(store, settings, "ab" * 32, clock=clock)
        run_id = runs.create(CONFIG + "[pipeline]\nstages = 2\ndrivers = 1\n", manifest(1000, 300, 300))
        token = runs.create_token(run_id, 3600, 5, "").token
        a, b = join(members, token), join(members, token)
        for n in (a, b):
            members.heartbeat(n, 0.0)
        leases = members.leases
        sa, _ = leases.acquire(run_id, a)
        assert sa is not None
        assert leases.acquire(run_id, a)[0].lease_id == sa.lease_id  # the driver keeps its own
        none, why = leases.acquire(run_id, b)  # a free shard, but the run has its one driver
        assert none is None and why == "the run has the 1 driver(s) its pipeline.drivers wants"
        # the driver goes silent: its lease expires and the next volunteer drives
        for _ in range(7):
            clock.t += 1
            members.heartbeat(b, 0.0)
            members.sweep()
        sb, _ = leases.acquire(run_id, b)
        assert sb is not None and sb.shard_id == sa.shard_id
    finally:
        store.close()


def test_a_refused_lease_says_why_by_a_typed_status_that_decides_stop_or_wait(ledger):
    """The node stops or waits on the reply's LeaseStatus, never on its words: "every unfinished
    shard is leased" contains "finished", and a node that read the words stopped at a run's end
    with its last shards untrained (issue 50)."""
    store, members, runs, clock, run_id, token = ledger
    a, b = join(members, token), join(members, token)
    members.heartbeat(a, 1.0)
    members.heartbeat(b, 1.0)
    leases = members.leases
    sa, why = leases.acquire(run_id, a)
    assert sa is not None and why.status == pb.LEASE_GRANTED
    sb, _ = leases.acquire(run_id, b)
    p = Progress(outer_step=1, loss=2.0, bytes_sent=0, seconds=1.0)
    leases.commit(run_id, b, sb.lease_id, sb.shard_id, 0, sb.tokens, p)  # b's shard done
    none, why = leases.acquire(run_id, b)  # a holds the other one
    assert none is None and why.status == pb.LEASE_ALL_LEASED and "unfinished" in why
    reply = pb.AcquireLeaseReply(granted=False, reason=why, status=why.status)
    assert lease_action(reply) is LeaseAction.WAIT
    runs.set_state(run_id, "paused")
    assert leases.acquire(run_id, b)[1].status == pb.LEASE_RUN_PAUSED
    runs.set_state(run_id, "active")
    leases.commit(run_id, a, sa.lease_id, sa.shard_id, 0, sa.tokens, p)
    none, why = leases.acquire(run_id, b)
    assert none is None and why.status == pb.LEASE_ALL_DONE
    assert lease_action(pb.AcquireLeaseReply(reason=why, status=why.status)) is LeaseAction.STOP
    runs.set_state(run_id, "finished")
    assert leases.acquire(run_id, b)[1].status == pb.LEASE_RUN_FINISHED


def test_a_reply_of_a_coordinator_from_before_the_status_is_read_as_it_was_meant():
    """No status (the field absent): a grant trains, "every shard is done" and a finished run
    stop, anything else waits, "unfinished" included."""
    old = pb.AcquireLeaseReply
    assert lease_action(old(granted=True)) is LeaseAction.TRAIN
    assert lease_action(old(reason="every shard is done")) is LeaseAction.STOP
    assert lease_action(old(reason="run r-1 is finished")) is LeaseAction.STOP
    assert lease_action(old(reason="every unfinished shard is leased; ask again later")) is LeaseAction.WAIT
    assert lease_action(old(reason="run r-1 is paused")) is LeaseAction.WAIT
    assert lease_action(old(reason="done", status=99)) is LeaseAction.WAIT  # a status newer than the node


def test_each_sweep_writes_its_share_of_the_heartbeats_longest_waiting_first(tmp_path):
    """Heartbeats are kept in memory and reach the ledger a share at each sweep (the part of
    heartbeat_flush_s since the last write), not all at once: at 10,000 nodes one write of all held
    the loop 150 ms. The longest-waiting go first, a node that beats again keeps its place, and
    within heartbeat_flush_s every row is written."""
    clock = Clock()
    settings = CoordinatorSettings(heartbeat_ttl_s=60, lease_ttl_s=60, heartbeat_flush_s=5)
    store = Store(tmp_path / "c.db")
    members = Membership(store, settings, identity.CertificateAuthority.create(), clock=clock)
    runs = Runs(store, settings, "ab" * 32, clock=clock)
    run_id = runs.create(CONFIG, manifest(1000))
    token = runs.create_token(run_id, 3600, 20, "").token
    nodes = [join(members, token) for _ in range(20)]
    start = clock.t
    written = lambda: {n for n in nodes if store.node(n)["last_heartbeat"] > start}  # noqa: E731
    clock.t += 0.1
    for n in nodes:
        members.heartbeat(n, 1.0)
    clock.t = start + 0.5  # a tenth of heartbeat_flush_s: 2 of the 20
    members.sweep()
    assert written() == set(nodes[:2]) and members.pending_count() == 18
    members.heartbeat(nodes[2], 1.0)  # waiting already: keeps its place at the front
    members.heartbeat(nodes[0], 1.0)  # written: waits again, behind the others
    clock.t = start + 1.5  # a fifth since the last write: 3 of the 19 waiting
    members.sweep()
    assert written() == set(nodes[:5]) and members.pending_count() == 16
    clock.t = start + 6.5  # heartbeat_flush_s since the last write: every one
    members.sweep()
    assert written() == set(nodes) and members.pending_count() == 0
    assert store.node(nodes[0])["last_heartbeat"] == start + 0.5  # its second heartbeat, written last
    store.close()
