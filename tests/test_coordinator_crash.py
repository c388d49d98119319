"""SIGKILL the coordinator during a burst of commits: nothing acknowledged is lost, nodes carry on."""

from __future__ import annotations

import asyncio
import threading

import pytest
from _coordinator_helpers import admin, admin_json, join, new_token, start_coordinator, write_run_files

from murmur.coordinator.store import Store
from murmur.protocol.coordinator_client import CoordinatorError

pytestmark = pytest.mark.integration

NODES = 4
SPAN = 10  # tokens per commit
SHARD_TOKENS = 2000
KILL_AFTER_ACKS = 120  # acknowledged commits (all nodes together) before the SIGKILL


def test_sigkill_during_commit_burst_loses_nothing_acknowledged(tmp_path):
    db = tmp_path / "coord.db"
    # Long TTLs: the restart must not cost anyone their lease (restart_grace_s covers the downtime).
    ttl = ["--heartbeat-ttl", "60", "--lease-ttl", "60", "--restart-grace", "60"]
    first = start_coordinator(db, *ttl)
    second = None
    try:
        config, manifest = write_run_files(tmp_path, [SHARD_TOKENS] * NODES)
        assert admin(first, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(first, "--uses", str(NODES))
        # Restart on the very same ports so the nodes' channels simply reconnect.
        ports = ["--node-listen", str(first.info["node_address"])]
        acked: list[tuple[str, int, int]] = []  # (lease id, shard, end offset) of every acknowledged commit
        killed = threading.Event()
        restarted = asyncio.Event()

        async def node(client, lease, loop_done: asyncio.Event) -> None:
            offset = lease.start_offset
            while offset < lease.end_offset:
                end = min(offset + SPAN, lease.end_offset)
                try:
                    reply = await client.commit(
                        lease.lease_id,
                        lease.shard_id,
                        offset,
                        end,
                        outer_step=end // SPAN,
                        loss=1.0,
                        bytes_sent=100,
                        seconds=0.01,
                    )
                except CoordinatorError:
                    # The coordinator is down (or restarting): retry the *same* commit. If it was applied
                    # before the kill, the retry is answered "duplicate": commits are idempotent.
                    await asyncio.sleep(0.05)
                    continue
                acked.append((lease.lease_id, lease.shard_id, end))
                offset = reply.committed_offset
                assert offset == end
                if len(acked) >= KILL_AFTER_ACKS and not killed.is_set():
                    killed.set()
                    first.kill()  # SIGKILL, mid-burst: other nodes have commits in flight
                if killed.is_set() and not restarted.is_set():
                    await restarted.wait()
            loop_done.set()

        async def scenario() -> None:
            nonlocal second
            clients = [await join(first, token) for _ in range(NODES)]
            leases = [(await c.acquire()).lease for c, _ in clients]
            assert len({lease.shard_id for lease in leases}) == NODES
            dones = [asyncio.Event() for _ in clients]
            tasks = [
                asyncio.create_task(node(c, lease, d)) for (c, _), lease, d in zip(clients, leases, dones, strict=True)
            ]
            while not killed.is_set():
                await asyncio.sleep(0.01)
            acked_at_kill = len(acked)
            second = await asyncio.to_thread(start_coordinator, db, *ttl, *ports, listen=first.address)
            restarted.set()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            assert len(acked) > acked_at_kill  # the nodes carried on after the restart
            for c, _ in clients:
                hb = await c.heartbeat()
                assert hb.run_state == "active"
                await c.close()

        asyncio.run(scenario())
        assert second is not None
        status = admin_json(second, "status")
        assert status["run"]["tokens_committed"] == NODES * SHARD_TOKENS
        assert status["run"]["shards_done"] == NODES
        second.stop()
        ledger = Store(db)
        try:
            assert ledger.check_consistency() == []
            for lease_id, shard_id, end in acked:  # every acknowledged commit is in the ledger
                record = ledger.commit_record(lease_id, end)
                assert record is not None and record["shard_id"] == shard_id, (lease_id, end)
            for shard in ledger.shards("test-run"):
                spans = [
                    (c["start_offset"], c["end_offset"]) for c in ledger.commits_of_shard("test-run", shard.shard_id)
                ]
                assert sum(e - s for s, e in spans) == SHARD_TOKENS  # every token exactly once
            kinds = [e["kind"] for e in ledger.events(limit=10_000)]
            assert kinds.count("coordinator_started") == 2
        finally:
            ledger.close()
    finally:
        first.kill()
        if second is not None:
            second.stop()
