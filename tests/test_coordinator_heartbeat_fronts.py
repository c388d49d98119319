"""Heartbeat fronts (``--heartbeat-fronts``): processes beside the coordinator's that carry the
nodes' heartbeat streams and hand the coordinator their beats in batches (coordinator/fronts.py).

A real coordinator process with two fronts: a node's first heartbeat (at the node address) names
its front, its next ones go there and keep it alive past its TTL, a refusal comes back through the
front with the coordinator's status, every other call stays at the node address; a client given
the front its join reply named opens its first stream there. A front
SIGKILLed costs its node at most one heartbeat (the next goes to the node address, whose reply
names the new front) and never its membership. The fronts end with the coordinator, stopped or
SIGKILLed: no process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import grpc
import psutil
import pytest
from _coordinator_helpers import FAST, admin, admin_json, join, new_token, start_coordinator, write_run_files

from murmur.coordinator.settings import CoordinatorSettings, SettingsError
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run

pytestmark = pytest.mark.integration
FRONTS = ["--heartbeat-fronts", "2", "--heartbeat-udp", "off"]  # the streams themselves (datagrams: their own test)


def fronts_of(coord) -> list[psutil.Process]:
    return [p for p in psutil.Process(coord.proc.pid).children(recursive=True)
            if "murmur.coordinator.heartbeat_front" in " ".join(p.cmdline())]


def started(tmp_path, *extra: str):
    coord = start_coordinator(tmp_path / "coord.db", *FAST, *FRONTS, *extra)
    config, manifest = write_run_files(tmp_path, [1000, 1000])
    assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
    return coord, new_token(coord, "--uses", "2")


def status_of(coord, node_id: str) -> str:
    return next(n["status"] for n in admin_json(coord, "nodes", "list")["nodes"] if n["node_id"] == node_id)


def test_a_front_carries_a_nodes_heartbeats_and_the_coordinators_refusal(tmp_path):
    coord, token = started(tmp_path)
    try:
        fronts = coord.info["heartbeat_fronts"]
        assert len(fronts) == 2 and all(fronts) and coord.info["node_address"] not in fronts
        assert len(fronts_of(coord)) == 2

        async def scenario() -> None:
            client, node_id = await join(coord, token)
            async with client:
                first = await client.heartbeat(1.0)
                assert first.heartbeat_address in fronts  # its front, by its node id
                lease = (await client.acquire()).lease
                replies = []

                async def beating() -> None:  # as a node does, also while the admin CLI runs
                    while True:
                        replies.append(await client.heartbeat(1.0))
                        await asyncio.sleep(0.2)

                beater = asyncio.create_task(beating())
                await asyncio.sleep(2 * 1.5)  # two heartbeat TTLs of FAST: alive only if the beats count
                assert await asyncio.to_thread(status_of, coord, node_id) == "active"
                # Every other call stays at the node address; the front's beats renewed the lease.
                done = await client.commit(lease.lease_id, lease.shard_id, 0, 100)
                assert done.committed_offset == 100
                beater.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beater
                assert len(replies) >= 3 and all(r.run_state == "active" for r in replies)
                assert {r.heartbeat_address for r in replies} == {first.heartbeat_address}
                assert client._front is not None  # the stream is the front's
                banned = admin(coord, "nodes", "ban", node_id, "--reason", "test")
                assert banned.returncode == 0, banned.stderr
                with pytest.raises(CoordinatorError, match="banned") as err:
                    await client.heartbeat(1.0)
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert client._beats is None and client.heartbeat_address == ""  # next: the node address
                with pytest.raises(CoordinatorError, match="banned"):
                    await client.heartbeat(1.0)

        asyncio.run(scenario())
        procs = fronts_of(coord)
    finally:
        assert coord.stop() == 0
    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive


def test_a_front_killed_costs_its_node_one_heartbeat_and_is_replaced(tmp_path):
    coord, token = started(tmp_path)
    try:

        async def scenario() -> None:
            ident, info = await join_run(coord.address, token, identity.generate_key())
            address, node_id = info.heartbeat_address, info.node_id
            assert address in coord.info["heartbeat_fronts"]  # the join reply names the node's front
            client = MemberClient(info.node_address, ident, server_name=info.tls_server_name,
                                  heartbeat_address=address)
            async with client:
                assert (await client.heartbeat(1.0)).heartbeat_address == address
                assert client._front is not None  # its very first stream went to the front
                port = int(address.rpartition(":")[2])
                (victim,) = [p for p in fronts_of(coord) if any(c.laddr.port == port for c in p.net_connections())]
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(30)
                failed = 0
                replies = []
                while not replies or not replies[-1].heartbeat_address:
                    try:  # the front's death fails at most the one beat on its stream
                        replies.append(await client.heartbeat(1.0))
                    except CoordinatorError:  # UNAVAILABLE or INTERNAL, as gRPC finds the connection
                        failed += 1
                    await asyncio.sleep(0.2)
                assert failed <= 1
                assert replies[-1].heartbeat_address != address  # the new front, on a port of its own
                assert (await client.heartbeat(1.0)).run_state == "active"
                assert client._front is not None
                assert status_of(coord, node_id) == "active"
                assert len(fronts_of(coord)) == 2

        asyncio.run(scenario())
    finally:
        assert coord.stop() == 0


def test_the_fronts_end_when_the_coordinator_is_killed(tmp_path):
    coord, _ = started(tmp_path)
    procs = fronts_of(coord)
    assert len(procs) == 2
    coord.kill()  # SIGKILL: no chance to stop them; their link closes
    gone, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive


def test_a_count_of_fronts_out_of_range_is_refused_in_one_line():
    with pytest.raises(SettingsError, match="heartbeat_fronts must be 0 to 64"):
        CoordinatorSettings(heartbeat_fronts=-1)
