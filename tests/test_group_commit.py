"""Commits that arrive together share one transaction (coordinator/group_commit.py), on a real
ledger: every caller is answered after the one COMMIT, a refused commit takes back only its own
writes (its refusal is still counted), and what the replies said is on disk for another reader."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest
from _coordinator_helpers import CONFIG, Clock

from murmur.coordinator.group_commit import GroupCommit
from murmur.coordinator.leases import BadCommit, LeaseLost, Progress
from murmur.coordinator.membership import Membership
from murmur.coordinator.runs import Runs
from murmur.coordinator.settings import CoordinatorSettings
from murmur.coordinator.store import Store
from murmur.protocol import identity


@pytest.fixture
def ledger(tmp_path):
    clock = Clock()
    settings = CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=5, lease_ttl_s=5)
    store = Store(tmp_path / "c.db")
    members = Membership(store, settings, identity.CertificateAuthority.create(), clock=clock)
    runs = Runs(store, settings, "ab" * 32, clock=clock)
    shards = {"shards": [{"id": i, "file": f"s{i}", "tokens": 1000} for i in range(3)]}
    run_id = runs.create(CONFIG, json.dumps(shards))
    token = runs.create_token(run_id, 3600, 5, "").token
    yield store, members, run_id, token, tmp_path / "c.db"
    store.close()


def test_commits_arriving_together_share_one_transaction_and_a_refused_one_takes_back_only_its_own(ledger):
    store, members, run_id, token, path = ledger
    nodes = [members.join(token, identity.make_csr(identity.generate_key()), {}, "").node_id for _ in range(3)]
    leases = [members.leases.acquire(run_id, n)[0] for n in nodes]
    p = Progress(outer_step=1, loss=2.0, bytes_sent=10, seconds=1.0)
    group = GroupCommit(store)

    def commit(i: int, start: int, end: int, lease_id: str | None = None):
        lease = leases[i]
        return lambda: members.leases.commit(run_id, nodes[i], lease_id or lease.lease_id, lease.shard_id,
                                             start, end, p)

    async def together():
        return await asyncio.gather(
            group.run(commit(0, 0, 400)),
            group.run(commit(1, 100, 500)),  # not from the committed offset: refused
            group.run(commit(2, 0, 300, lease_id="not-the-lease")),  # a lease it does not hold: refused, counted
            group.run(commit(1, 0, 200)),
            return_exceptions=True,
        )

    first, wrong_start, wrong_lease, second = asyncio.run(together())
    assert (group.batches, group.calls) == (1, 4)  # one transaction, one fsync
    assert first.committed_offset == 400 and second.committed_offset == 200
    assert isinstance(wrong_start, BadCommit) and isinstance(wrong_lease, LeaseLost)
    # On disk, as another reader sees it: the two accepted commits and the refusal's count, nothing
    # of the refused commits.
    other = sqlite3.connect(path)
    offsets = dict(other.execute("SELECT shard_id, committed_offset FROM shards WHERE run_id = ?", (run_id,)))
    assert [offsets[lz.shard_id] for lz in leases] == [400, 200, 0]
    assert other.execute("SELECT COUNT(*) FROM commits").fetchone()[0] == 2
    assert other.execute("SELECT COUNT(*) FROM events WHERE kind = 'commit_refused'").fetchone()[0] == 1
    other.close()
    assert store.counter("commits_refused") == 1 and store.check_consistency() == []

    async def alone():  # light load: a batch of one, answered as before
        return await group.run(commit(2, 0, 1000))

    assert asyncio.run(alone()).shard_done and (group.batches, group.calls) == (2, 5)


def test_a_nested_write_that_fails_takes_back_its_own_writes_only(ledger):
    store = ledger[0]
    with store.write():
        store.bump("a")
        with pytest.raises(RuntimeError), store.write():
            store.bump("b")
            raise RuntimeError("refused")
        store.bump("c")
    assert (store.counter("a"), store.counter("b"), store.counter("c")) == (1, 0, 1)


def test_calls_that_arrive_while_a_batch_fsyncs_are_the_next_batch_and_nobody_is_answered_before_its_fsync(ledger):
    """The fsync runs off the loop (Store.sync in a worker thread): while it runs, the loop takes
    the calls that come, and they share the next transaction. Here the first batch's fsync is held
    until three more calls have queued behind it."""
    import threading

    store, members, run_id, token, _ = ledger
    group = GroupCommit(store)
    in_sync, release = threading.Event(), threading.Event()
    syncs: list[int] = []
    real_sync = store.sync

    def held_sync() -> None:  # the real fsync, once the test lets it through
        in_sync.set()
        release.wait(timeout=30)
        real_sync()
        syncs.append(group.batches)

    store.sync = held_sync  # type: ignore[method-assign]
    csrs = [identity.make_csr(identity.generate_key()) for _ in range(4)]

    def join(i: int):
        return lambda: members.join(token, csrs[i], {}, "")

    async def scenario():
        first = asyncio.ensure_future(group.run(join(0)))
        await asyncio.to_thread(in_sync.wait, 30)  # batch 1 (one join) is fsyncing; the loop runs on
        rest = [asyncio.ensure_future(group.run(join(i))) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        assert not first.done() and not any(r.done() for r in rest)  # nothing answered before its fsync
        release.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(scenario())
    assert (group.batches, group.calls) == (2, 4) and syncs == [0, 1]  # two transactions, two fsyncs
    assert len({first.node_id, *(j.node_id for j in rest)}) == 4
    other = sqlite3.connect(ledger[4])  # every answered join is in the ledger for another reader
    assert other.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] == 4
    other.close()


def test_a_call_whose_caller_gave_up_while_it_queued_is_not_run(ledger):
    """A call queued behind a batch's fsync whose client gave up (its deadline: the handler is
    cancelled) is left out of the next batch: nothing of it runs. Its function read the ended
    call's certificate once, and gRPC, which had freed that call, crashed the coordinator with a
    segfault (10,000 simulated nodes, commits every 10 s)."""
    import threading

    store, members, run_id, token, _ = ledger
    group = GroupCommit(store)
    in_sync, release = threading.Event(), threading.Event()
    real_sync = store.sync

    def held_sync() -> None:
        in_sync.set()
        release.wait(timeout=30)
        real_sync()

    store.sync = held_sync  # type: ignore[method-assign]
    ran: list[int] = []

    def join(i: int):
        def fn():
            ran.append(i)
            return members.join(token, identity.make_csr(identity.generate_key()), {}, "")
        return fn

    async def scenario():
        first = asyncio.ensure_future(group.run(join(0)))
        await asyncio.to_thread(in_sync.wait, 30)
        gave_up, stays = asyncio.ensure_future(group.run(join(1))), asyncio.ensure_future(group.run(join(2)))
        await asyncio.sleep(0)  # both queued for the next batch
        gave_up.cancel()
        release.set()
        await first
        await stays
        return gave_up.cancelled()

    assert asyncio.run(scenario())
    assert ran == [0, 2] and (group.batches, group.calls) == (2, 2)
    other = sqlite3.connect(ledger[4])
    assert other.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] == 2
    other.close()
