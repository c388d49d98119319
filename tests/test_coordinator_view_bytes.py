"""The whole live-trainer view sent as bytes serialized once per version (coordinator/preserialized.py).

A real coordinator process with several trainers (real member clients, their own mutual-TLS
channels): a unary Heartbeat, a datagram too large for the view that falls back to the gRPC
stream, and a stream carried by a heartbeat front each answer with the whole view, and the node's
own code (MemberClient.take_view / members) reads every trainer's entry and every other field
right. A trainer that joins or leaves makes a new version whose whole view lists it or not: the
bytes of an older version are never what is sent.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from _coordinator_helpers import FAST, admin, new_token, start_coordinator, write_run_files

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import heartbeat_datagram as hd
from murmur.protocol import identity
from murmur.protocol.coordinator_client import MemberClient, join_run

pytestmark = pytest.mark.integration
# FAST, but a trainer is lost only after 6 s of silence: the test's beats go one client after the
# other, and a loss in between would change the view under the assertions.
SLOW_LOSS = [*FAST, "--heartbeat-ttl", "6"]
TRAINERS = 10  # their whole view is some 1.4 kB: more than a datagram carries (1,206 bytes)


def metric(coord, name: str, label: str) -> int:
    with urllib.request.urlopen(f"http://{coord.info['metrics']}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{name}_total{{{label}}} ([0-9.e+]+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


def calls(coord, method: str) -> int:
    return metric(coord, "murmur_rpc_calls", f'method="{method}"')


def peer(i: int) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(incarnation=f"incarnation-{i}", peer_address=f"10.0.0.{i}:7800", round=i % 3,
                               state_hash=f"{i:064x}")


def entry(i: int) -> tuple[str, str, int, str]:
    p = peer(i)
    return p.incarnation, p.peer_address, p.round, p.state_hash


async def joined_trainers(coord, token: str, n: int) -> list[tuple[MemberClient, str]]:
    out = []
    for _ in range(n):
        ident, info = await join_run(coord.address, token, identity.generate_key())
        out.append((MemberClient(info.node_address, ident, server_name=info.tls_server_name,
                                 heartbeat_udp=info.heartbeat_udp), info.node_id))
    return out


async def listed(clients: list[MemberClient]) -> None:
    """Heartbeat as trainers until the coordinator lists trainers (one heartbeat TTL after it
    started), then once more each: every one is in the view."""
    for i, c in enumerate(clients):
        while not (await c.heartbeat(1.0, peer=peer(i))).view_whole:
            await asyncio.sleep(0.1)
    for i, c in enumerate(clients):
        await c.heartbeat(1.0, peer=peer(i))


def check_whole(client: MemberClient, reply: pb.HeartbeatReply, want: dict[str, tuple[str, str, int, str]]) -> None:
    """The reply lists the whole view (no delta) as the node's code reads it, and its other fields."""
    assert reply.view_whole and not reply.view_delta and not reply.view_unchanged
    got = {m.node_id: (m.incarnation, m.peer_address, m.round, m.state_hash) for m in client.members(reply)}
    assert got == want
    assert client.view_version == reply.view_version and set(client.view_members) == set(want)
    assert reply.run_state == "active" and reply.heartbeat_interval_s == 0.2 and reply.coordinator_started_at > 0


def run_token(tmp_path, coord, uses: int) -> str:
    config, manifest = write_run_files(tmp_path, [1000] * 4)
    created = admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest))
    assert created.returncode == 0, created.stderr
    return new_token(coord, "--uses", str(uses))


def test_unary_and_datagram_fallback_replies_carry_the_whole_view_and_follow_its_versions(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *SLOW_LOSS)
    try:
        token = run_token(tmp_path, coord, TRAINERS + 1)

        async def scenario() -> None:
            trainers = await joined_trainers(coord, token, TRAINERS)
            clients = [c for c, _ in trainers]
            want = {node_id: entry(i) for i, (_, node_id) in enumerate(trainers)}
            try:
                await listed(clients)
                # Unary (a node's starting heartbeat is): a node holding no view gets the whole one.
                unary = calls(coord, "Heartbeat")
                clients[0].view_version = 0
                reply = await clients[0].heartbeat(1.0, peer=peer(0), starting=True)
                check_whole(clients[0], reply, want)
                assert calls(coord, "Heartbeat") == unary + 1
                assert reply.ByteSize() > hd.MAX_REPLY_PAYLOAD  # so as a datagram it is too large:

                # A datagram: the coordinator answers "use gRPC" from the view's cached length, and
                # the node makes the beat on its stream, whose reply is the whole view.
                too_large = metric(coord, "murmur_heartbeat_datagrams", 'outcome="use_grpc_too_large"')
                streamed = calls(coord, "HeartbeatStream")
                clients[1].view_version = 0
                assert clients[1].datagrams.usable()
                reply = await clients[1].heartbeat(1.0, peer=peer(1))
                check_whole(clients[1], reply, want)
                assert metric(coord, "murmur_heartbeat_datagrams", 'outcome="use_grpc_too_large"') == too_large + 1
                assert calls(coord, "HeartbeatStream") == streamed + 1
                held = reply.view_version

                # A trainer joins: a new version, whose whole view lists it.
                newcomer, new_id = (await joined_trainers(coord, token, 1))[0]
                await newcomer.heartbeat(1.0, peer=peer(TRAINERS))
                want[new_id] = entry(TRAINERS)
                for i in (0, 1):
                    clients[i].view_version = 0
                reply = await clients[0].heartbeat(1.0, peer=peer(0), starting=True)
                check_whole(clients[0], reply, want)
                joined_version = reply.view_version
                assert joined_version != held
                check_whole(clients[1], await clients[1].heartbeat(1.0, peer=peer(1)), want)
                assert clients[1].view_version == joined_version

                # It leaves: a new version again, whose whole view does not list it.
                await newcomer.leave("done")
                await newcomer.close()
                del want[new_id]
                for i in (0, 1):
                    clients[i].view_version = 0
                reply = await clients[0].heartbeat(1.0, peer=peer(0), starting=True)
                check_whole(clients[0], reply, want)
                assert reply.view_version not in (held, joined_version)
                check_whole(clients[1], await clients[1].heartbeat(1.0, peer=peer(1)), want)
                # A node holding a recent version (from before the join) is sent only the changes.
                delta = await clients[2].heartbeat(1.0, peer=peer(2))
                assert delta.view_delta and delta.view_version == reply.view_version
                assert set(clients[2].view_members) == set(want)
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(scenario())
    finally:
        coord.stop()


def test_a_heartbeat_front_carries_the_whole_views_bytes(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *SLOW_LOSS, "--heartbeat-fronts", "1", "--heartbeat-udp", "off")
    try:
        token = run_token(tmp_path, coord, 3)

        async def scenario() -> None:
            trainers = await joined_trainers(coord, token, 3)
            clients = [c for c, _ in trainers]
            want = {node_id: entry(i) for i, (_, node_id) in enumerate(trainers)}
            try:
                await listed(clients)
                watcher = clients[0]
                assert watcher._front is not None  # its stream is the front's (the reply named it)
                watcher.view_version = 0
                reply = await watcher.heartbeat(1.0, peer=peer(0))
                check_whole(watcher, reply, want)
                assert reply.heartbeat_address == coord.info["heartbeat_fronts"][0] and watcher._front is not None
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(scenario())
    finally:
        assert coord.stop() == 0
