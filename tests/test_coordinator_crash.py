"""SIGKILL the coordinator during a burst of commits, or of joins: nothing acknowledged is lost,
nodes carry on."""

from __future__ import annotations

import asyncio
import re
import threading
import urllib.request

import grpc
import pytest
from _coordinator_helpers import admin, admin_json, join, new_token, start_coordinator, write_run_files

from murmur.coordinator.store import Store
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import coordinator_pb2_grpc as pb_grpc
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient
from murmur.protocol.jointoken import JoinToken, fetch_pinned_ca
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata

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


JOINERS = 48  # joins sent at once
KILL_AFTER_JOINS = 24  # acknowledged joins before the SIGKILL


def _counter(coord, name: str) -> int:
    with urllib.request.urlopen(f"http://{coord.info['metrics']}/metrics", timeout=30) as reply:
        found = re.search(rf"^{name}_total ([0-9.e+]+)$", reply.read().decode(), re.M)
    return int(float(found.group(1))) if found else 0


def test_sigkill_during_a_join_storm_loses_no_acknowledged_join(tmp_path):
    """Joins that arrive together share one transaction and one fsync (coordinator/group_commit.py,
    the fsync off the loop): the coordinator SIGKILLed once some are answered, every answered one
    is in the ledger, its token use counted, and its node a member of the restarted coordinator."""
    db = tmp_path / "coord.db"
    first = start_coordinator(db)
    second = None
    try:
        config, manifest = write_run_files(tmp_path, [1000] * JOINERS)
        assert admin(first, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(first, "--uses", str(JOINERS))
        acked: list[tuple[str, identity.Identity]] = []
        batched: list[tuple[int, int]] = []
        killed = asyncio.Event()
        # As nodes join, each with its own key and CSR, but sent at once over one channel (the CA
        # read once), so that they arrive together, as in a join storm.
        ca_pem = fetch_pinned_ca(first.address, JoinToken.parse(token).ca_fingerprint)

        async def storm() -> None:
            creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
            options = [("grpc.ssl_target_name_override", "murmur-coordinator")]
            async with grpc.aio.secure_channel(first.address, creds, options=options) as channel:
                stub = pb_grpc.CoordinatorStub(channel)

                async def joiner() -> None:
                    key = identity.generate_key()
                    request = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, token=token,
                                             csr_pem=identity.make_csr(key))
                    try:
                        reply = await stub.Join(request, metadata=version_metadata(), timeout=60)
                    except grpc.aio.AioRpcError:  # in flight at the kill: never answered, nothing promised
                        return
                    # (a reply read after the kill was sent before it: acknowledged all the same)
                    acked.append((reply.node_id, identity.Identity(key=key, cert_pem=reply.certificate_pem,
                                                                   ca_cert_pem=ca_pem)))
                    if len(acked) >= KILL_AFTER_JOINS and not killed.is_set():
                        batched.append((_counter(first, "murmur_group_commit_calls"),
                                        _counter(first, "murmur_group_commit_batches")))
                        first.kill()  # SIGKILL, other joins in flight
                        killed.set()

                await asyncio.gather(*(joiner() for _ in range(JOINERS)))

        asyncio.run(storm())
        assert killed.is_set() and len(acked) >= KILL_AFTER_JOINS
        calls, batches = batched[0]
        assert calls >= KILL_AFTER_JOINS and batches < calls  # joins did share transactions

        ledger = Store(db)
        try:
            nodes = {r["node_id"]: r["status"] for r in ledger.nodes()}
            assert all(nodes.get(node_id) == "active" for node_id, _ in acked), "an acknowledged join was lost"
            joins = [e["node_id"] for e in ledger.events(limit=10_000, kind="join")]
            assert set(joins) == set(nodes)  # every node in the ledger joined by the book, once
            token_row = ledger.token(token.split(".")[1])
            assert token_row["uses_left"] == JOINERS - len(nodes)  # each join in the ledger used the token
            assert ledger.check_consistency() == []
        finally:
            ledger.close()

        second = start_coordinator(db)

        async def still_a_member() -> None:
            node_id, ident = acked[0]
            client = MemberClient(str(second.info["node_address"]), ident)
            async with client:
                reply = await client.acquire()
                assert reply.lease.shard_id >= 0 and (await client.heartbeat()).run_state == "active"

        asyncio.run(still_a_member())
    finally:
        first.kill()
        if second is not None:
            second.stop()
