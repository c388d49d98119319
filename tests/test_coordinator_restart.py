"""A coordinator restart is invisible to nodes: the grace period counts from when it serves again,
and its DHT comes back with the same peer id and port (the bootstrap addresses nodes saved)."""

from __future__ import annotations

import asyncio

import pytest
from _coordinator_helpers import admin_json, join, new_token, start_coordinator, write_run_files

pytestmark = pytest.mark.integration

HEARTBEAT_TTL_S = 1.5
SHORT = ["--heartbeat-interval", "0.2", "--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--lease-ttl",
         str(HEARTBEAT_TTL_S), "--sweep-interval", "0.1", "--restart-grace", "30"]


def test_a_lease_outlives_restarts_when_its_node_returns_within_the_grace(tmp_path):
    """Nodes come back a while after a restart (their channels back off): the grace must count from
    when the coordinator serves again. A node silent for twice the heartbeat TTL after each of three
    restarts, but within the grace, keeps its node status and lease, and its next commit is accepted."""
    db = tmp_path / "coord.db"
    coord = start_coordinator(db, *SHORT)
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        admin_json(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest))
        token = new_token(coord)
        node_listen = str(coord.info["node_address"])

        async def scenario() -> None:
            nonlocal coord
            client, node_id = await join(coord, token)
            lease = (await client.acquire()).lease
            offset = lease.start_offset
            for _ in range(3):
                reply = await client.commit(lease.lease_id, lease.shard_id, offset, offset + 10)
                assert reply.committed_offset == offset + 10, reply
                offset += 10
                await asyncio.to_thread(coord.kill)
                coord = await asyncio.to_thread(
                    start_coordinator, db, *SHORT, "--node-listen", node_listen, listen=coord.address
                )
                # The scenario is a silence: longer than the heartbeat TTL, well within the grace.
                await asyncio.sleep(2 * HEARTBEAT_TTL_S)
            reply = await client.commit(lease.lease_id, lease.shard_id, offset, offset + 10)
            assert reply.committed_offset == offset + 10, reply
            await client.close()
            nodes = {n["node_id"]: n for n in admin_json(coord, "nodes", "list")["nodes"]}
            assert nodes[node_id]["status"] == "active", nodes[node_id]

        asyncio.run(scenario())
        kinds = [e["kind"] for e in admin_json(coord, "events", "--limit", "500")["events"]]
        assert kinds.count("coordinator_started") == 4, kinds
        assert "lost" not in kinds and "lease_expired" not in kinds, kinds
    finally:
        coord.stop()


def test_the_dht_comes_back_with_the_same_peer_id_and_port(tmp_path):
    db = tmp_path / "coord.db"
    coord = start_coordinator(db, "--dht", dht=True)
    try:
        first = coord.info["dht"]
        assert first, coord.info
        coord.kill()
        coord = start_coordinator(db, "--dht", dht=True)
        assert coord.info["dht"] == first
    finally:
        coord.stop()


def test_a_restart_on_an_address_another_process_holds_fails_with_a_clear_line_instead_of_sharing_it(tmp_path):
    """gRPC binds with SO_REUSEPORT unless told not to: a coordinator restarted on its address
    while a stranger's gRPC server held the port would have bound it too, and the nodes'
    connections would have been split between the two."""
    from concurrent import futures

    import grpc

    stranger = grpc.server(futures.ThreadPoolExecutor(1))  # gRPC's defaults, as any other program's
    port = stranger.add_insecure_port("127.0.0.1:0")
    stranger.start()
    try:
        with pytest.raises(RuntimeError, match=r"cannot listen on 127\.0\.0\.1:\d+ .*is the port taken\?"):
            start_coordinator(tmp_path / "coord.db", listen=f"127.0.0.1:{port}")
    finally:
        stranger.stop(0)
