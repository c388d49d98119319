"""Heartbeats as signed UDP datagrams (coordinator/heartbeat_udp.py, protocol/heartbeat_udp_client.py).

A real coordinator process and real member clients: the heartbeats go as datagrams (its metrics
count them served, and no gRPC heartbeat), the node is live in the coordinator's view; forged,
replayed, truncated, garbage and oversized datagrams are dropped unanswered and counted while it
keeps serving; a reply too large for a datagram (the whole view of many trainers) makes the beat
go over gRPC and the view the node holds stays right; a refusal keeps its gRPC status; with the
coordinator's UDP off, or datagrams going where nobody answers, the node heartbeats over the
stream; a restarted coordinator (new keys) is followed.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from _coordinator_helpers import FAST, admin, admin_json, new_token, start_coordinator, write_run_files
from _node_helpers import UNTIL_STOPPED, log, make_testnet, small_dataset, wait_rounds

from murmur.coordinator.settings import CoordinatorSettings, SettingsError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import heartbeat_datagram as hd
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run
from murmur.protocol.heartbeat_udp_client import DatagramBeats

pytestmark = pytest.mark.integration


def metric(coord, name: str, label: str = "") -> int:
    with urllib.request.urlopen(f"http://{coord.info['metrics']}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{name}_total{{{label}}} ([0-9.e+]+)$" if label else rf"^{name}_total ([0-9.e+]+)$",
                      text, re.M)
    return int(float(found.group(1))) if found else 0


def latency_histogram(coord) -> dict[str, float]:
    """murmur_heartbeat_datagram_seconds's series: count, sum and bucket{le="..."}."""
    with urllib.request.urlopen(f"http://{coord.info['metrics']}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^murmur_heartbeat_datagram_seconds_(\S+) ([0-9.e+-]+)$", text, re.M)}


def served(coord) -> int:
    return metric(coord, "murmur_heartbeat_datagrams", 'outcome="served"')


def dropped(coord, reason: str) -> int:
    return metric(coord, "murmur_heartbeat_datagrams_dropped", f'reason="{reason}"')


def grpc_beats(coord) -> int:
    return sum(metric(coord, "murmur_rpc_calls", f'method="{m}"') for m in ("Heartbeat", "HeartbeatStream"))


async def join(coord, token: str):
    ident, info = await join_run(coord.address, token, identity.generate_key())
    client = MemberClient(info.node_address, ident, server_name=info.tls_server_name, heartbeat_udp=info.heartbeat_udp)
    return client, info


def trainer(i: int, round_id: int = 0) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(incarnation=f"incarnation-{i}", peer_address=f"10.0.0.{i}:7800", round=round_id,
                               state_hash=f"{round_id:064x}")


async def whole_view(client: MemberClient, i: int) -> pb.HeartbeatReply:
    """Heartbeat as trainer i until the coordinator lists trainers (one heartbeat TTL after it started)."""
    while not (reply := await client.heartbeat(1.0, peer=trainer(i))).view_whole:
        await asyncio.sleep(0.1)
    return reply


def run_with_token(tmp_path, coord, uses: int) -> str:
    config, manifest = write_run_files(tmp_path, [1000] * 4)
    created = admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest))
    assert created.returncode == 0, created.stderr
    return new_token(coord, "--uses", str(uses))


class Raw:
    """A plain UDP socket of the test's: it sends what it likes and reads what comes back."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.settimeout(10.0)  # a failure's bound only: each wait is for a reply that comes
        self.sock.connect(hd.split_host_port(address))

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def reply(self, key: bytes) -> hd.Reply:
        return hd.decode_reply(key, self.sock.recv(65536))


def test_heartbeats_go_as_datagrams_and_bad_ones_are_dropped_unanswered(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *FAST)
    try:
        assert coord.info["heartbeat_udp"].startswith("127.0.0.1:"), coord.info
        token = run_with_token(tmp_path, coord, 2)

        async def scenario() -> None:
            client, info = await join(coord, token)
            other, other_info = await join(coord, token)
            assert info.heartbeat_udp_address == coord.info["heartbeat_udp"] and len(info.heartbeat_udp_key) == 32
            assert info.heartbeat_udp_key != other_info.heartbeat_udp_key  # one key per node
            async with client, other:
                await whole_view(client, 1)
                reply = await whole_view(other, 2)
                # The node is live in the coordinator's view: the other trainer's reply lists it.
                assert info.node_id in {m.node_id for m in other.members(reply)}
                assert served(coord) >= 2 and grpc_beats(coord) == 0
                assert client._beats is None and client.datagrams.answered >= 1

                raw = Raw(info.heartbeat_udp_address)
                key, node = info.heartbeat_udp_key, info.node_id
                beat = pb.HeartbeatRequest(tokens_per_s=3.0).SerializeToString()
                good = hd.encode_beat(key, node, time.time_ns(), beat)
                raw.send(good)
                answer = raw.reply(key)
                assert answer.counter == hd.decode_beat(good).counter
                assert pb.HeartbeatReply.FromString(answer.reply).run_state == "active"

                forged = hd.encode_beat(other_info.heartbeat_udp_key, node, time.time_ns(), beat)  # another's key
                stranger = hd.encode_beat(key, "f" * 64, time.time_ns(), beat)  # a node id never given a key
                for bad in (forged, stranger, good, good[:25], b"\x00 not a heartbeat at all",
                            good[:-16] + b"x" * 2000 + good[-16:]):
                    raw.send(bad)
                # Nothing of those was answered: the next thing that comes back answers the next good beat.
                last = hd.encode_beat(key, node, time.time_ns(), beat)
                raw.send(last)
                assert raw.reply(key).counter == hd.decode_beat(last).counter
                assert (dropped(coord, "bad_tag"), dropped(coord, "replay")) == (2, 1)
                assert (dropped(coord, "malformed"), dropped(coord, "oversized")) == (2, 1)
                raw.sock.close()

                before = served(coord)
                assert (await client.heartbeat(1.0, peer=trainer(1))).run_state == "active"  # still serving
                assert served(coord) == before + 1 and grpc_beats(coord) == 0
                # Every beat answered, and nothing dropped, is timed from its arrival to its reply.
                timed = latency_histogram(coord)
                assert timed["count"] == timed['bucket{le="+Inf"}'] == served(coord)
                assert 0 < timed["sum"] < 10 * timed["count"]

                # A refusal keeps its gRPC status: the datagram says "use gRPC", gRPC refuses by name.
                banned = admin(coord, "nodes", "ban", info.node_id, "--reason", "test")
                assert banned.returncode == 0, banned.stderr
                with pytest.raises(CoordinatorError, match="banned") as err:
                    await client.heartbeat(1.0)
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert metric(coord, "murmur_heartbeat_datagrams", 'outcome="use_grpc_refused"') == 1

        asyncio.run(scenario())
    finally:
        coord.stop()


def test_a_reply_too_large_for_a_datagram_goes_over_grpc_and_the_view_stays_right(tmp_path):
    """Ten trainers' whole view is some 2 kB: the beat that needs it goes over gRPC; the beats after
    (view unchanged, or one trainer's change) fit datagrams, and the node's view follows them."""
    coord = start_coordinator(tmp_path / "coord.db", *FAST)
    try:
        n = 10
        token = run_with_token(tmp_path, coord, n)

        async def scenario() -> None:
            joined = [await join(coord, token) for _ in range(n)]
            clients = [c for c, _ in joined]
            try:
                for i, c in enumerate(clients):
                    await whole_view(c, i + 1)
                for i, c in enumerate(clients):  # each now holds a view with every trainer
                    await c.heartbeat(1.0, peer=trainer(i + 1))
                watcher = clients[0]
                assert len(watcher.view_members) == n
                too_large = metric(coord, "murmur_heartbeat_datagrams", 'outcome="use_grpc_too_large"')
                assert too_large >= 1 and grpc_beats(coord) >= 1  # the whole views went over gRPC
                # One trainer reports a new round: the watcher's next replies carry that change (a
                # delta of one trainer: a datagram), until its view shows it.
                mover = joined[3][1].node_id
                await clients[3].heartbeat(1.0, peer=trainer(4, round_id=7))
                before = served(coord)
                while watcher.view_members[mover].round != 7:
                    await watcher.heartbeat(1.0, peer=trainer(1))
                assert served(coord) > before
                assert sorted(watcher.view_members) == sorted(info.node_id for _, info in joined)
                assert {m.round for m in watcher.view_members.values()} == {0, 7}
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(scenario())
    finally:
        coord.stop()


def test_with_the_coordinators_udp_off_or_unanswered_the_node_heartbeats_over_the_stream(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *FAST, "--heartbeat-udp", "off")
    hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a port that takes datagrams and never answers
    hole.bind(("127.0.0.1", 0))
    try:
        assert coord.info["heartbeat_udp"] == ""
        token = run_with_token(tmp_path, coord, 1)

        async def scenario() -> None:
            ident, info = await join_run(coord.address, token, identity.generate_key())
            assert info.heartbeat_udp == ("", b"")
            # Offered a datagram address where nobody answers (as if a firewall dropped UDP): the
            # beat waits its short while, then goes over gRPC, whose reply offers no datagrams.
            blackhole = (f"127.0.0.1:{hole.getsockname()[1]}", b"k" * 32)
            async with MemberClient(info.node_address, ident, server_name=info.tls_server_name,
                                    heartbeat_udp=blackhole) as client:
                for _ in range(3):
                    assert (await client.heartbeat(1.0)).run_state == "active"
                assert client.datagrams.sent == 1 and client.datagrams.missed == 1
                assert not client.datagrams.usable()
                assert metric(coord, "murmur_rpc_calls", 'method="HeartbeatStream"') == 3

        asyncio.run(scenario())
        assert hole.recv(65536)  # the one datagram did go there
    finally:
        hole.close()
        coord.stop()


def test_datagrams_that_go_unanswered_pause_and_are_tried_again_later():
    """A firewall dropping UDP: after a few unanswered beats in a row datagrams pause (no wait per
    beat), and are tried again once the pause is over; a closed port (ICMP unreachable) is a miss
    at once, with no wait."""
    hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    hole.bind(("127.0.0.1", 0))
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    closed_address = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nobody listens there now: the kernel answers "port unreachable"
    now = [0.0]

    async def scenario() -> None:
        beats = DatagramBeats("a" * 64, wait_s=0.05, misses_before_pause=3, pause_s=60.0, clock=lambda: now[0])
        beats.offer(f"127.0.0.1:{hole.getsockname()[1]}", b"k" * 32)
        for _ in range(3):
            assert beats.usable()
            assert await beats.beat(pb.HeartbeatRequest()) is None
        assert not beats.usable() and beats.sent == 3 and beats.missed == 3
        now[0] += 59.0
        assert not beats.usable()
        now[0] += 1.0
        assert beats.usable()
        beats.offer(closed_address, b"k" * 32)
        began = time.monotonic()
        assert await beats.beat(pb.HeartbeatRequest()) is None
        assert beats.missed == 4
        beats.close()
        assert time.monotonic() - began < 10.0  # a failure's bound, not a timing claim

    try:
        asyncio.run(scenario())
        received = [hole.recv(65536) for _ in range(3)]
        assert [hd.decode_beat(d).verify(b"k" * 32) for d in received] == [True] * 3
        counters = [hd.decode_beat(d).counter for d in received]
        assert counters == sorted(set(counters))  # strictly increasing
    finally:
        hole.close()


def test_a_coordinator_that_answers_late_is_waited_for_not_fallen_back_from():
    """An answer after its beat's wait shows a slow coordinator, not a lossy path: the next beats
    wait longer for theirs instead of coming again over gRPC (which made an overloaded coordinator
    busier), and the late answer keeps datagrams from pausing. Here a real socket answers every
    beat, signed, late: the first 0.6 s after it came, the others 0.15 s; the first beat's wait is
    0.05 s, the later ones' SLOW_WAIT_S (1 s)."""
    key = b"k" * 32
    slow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    slow.bind(("127.0.0.1", 0))
    slow.settimeout(30)

    def answer_late(delays: list[float]) -> None:
        for delay in delays:
            data, sender = slow.recvfrom(65536)
            time.sleep(delay)
            reply = pb.HeartbeatReply(run_round=7).SerializeToString()
            slow.sendto(hd.encode_reply(key, hd.decode_beat(data).counter, reply), sender)

    async def scenario() -> list:
        beats = DatagramBeats("a" * 64, wait_s=0.05, misses_before_pause=2, pause_s=60.0)
        beats.offer(f"127.0.0.1:{slow.getsockname()[1]}", key)
        first = await beats.beat(pb.HeartbeatRequest())  # no sign of slowness yet: its wait is short
        for _ in range(3000):  # its answer comes, late
            if beats.late:
                break
            await asyncio.sleep(0.01)
        assert beats.late == 1 and beats.wait() >= 1.0
        later = [await beats.beat(pb.HeartbeatRequest()) for _ in range(3)]
        beats.close()
        return [first, *later, beats]

    import threading

    server = threading.Thread(target=answer_late, args=([0.6, 0.15, 0.15, 0.15],), daemon=True)
    server.start()
    try:
        first, *later, beats = asyncio.run(scenario())
        server.join(30)
    finally:
        slow.close()
    assert first is None  # over gRPC, as before
    assert [r.run_round for r in later] == [7, 7, 7]  # by datagram, waited for
    assert beats.usable() and beats.missed == 1 and beats.answered == 3


def test_a_restarted_coordinators_new_keys_are_followed(tmp_path):
    db = tmp_path / "coord.db"
    coord = start_coordinator(db, *FAST)
    try:
        token = run_with_token(tmp_path, coord, 1)
        udp_port = coord.info["heartbeat_udp"].rpartition(":")[2]
        node_listen = str(coord.info["node_address"])

        async def scenario() -> None:
            nonlocal coord
            client, info = await join(coord, token)
            async with client:
                await client.heartbeat(1.0)
                assert served(coord) == 1
                old_key = client.datagrams.key
                await asyncio.to_thread(coord.kill)
                coord = await asyncio.to_thread(start_coordinator, db, *FAST, "--node-listen", node_listen,
                                                "--heartbeat-udp", udp_port, listen=coord.address)
                assert coord.info["heartbeat_udp"] == info.heartbeat_udp_address  # same address, new secret
                # The old key's datagrams fail the new process's check; the beat goes over gRPC (a
                # first try may fail while the channel reconnects), whose reply carries the new key.
                while True:
                    try:
                        await client.heartbeat(1.0)
                        break
                    except CoordinatorError as err:
                        assert err.code == grpc.StatusCode.UNAVAILABLE, err
                        await asyncio.sleep(0.2)
                assert client.datagrams.key != old_key
                assert dropped(coord, "bad_tag") >= 1
                await client.heartbeat(1.0)
                assert served(coord) >= 1
            nodes = {n["node_id"]: n for n in admin_json(coord, "nodes", "list")["nodes"]}
            assert nodes[info.node_id]["status"] == "active"

        asyncio.run(scenario())
    finally:
        coord.stop()


def test_with_heartbeat_fronts_the_datagrams_still_go_to_the_coordinator_process(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *FAST, "--heartbeat-fronts", "1")
    try:
        assert coord.info["heartbeat_udp"] and coord.info["heartbeat_udp"] not in coord.info["heartbeat_fronts"]
        token = run_with_token(tmp_path, coord, 1)

        async def scenario() -> None:
            client, info = await join(coord, token)
            async with client:
                for _ in range(3):
                    assert (await client.heartbeat(1.0)).heartbeat_address in coord.info["heartbeat_fronts"]
                assert client._front is None and client._beats is None  # no stream opened, at a front or here
            assert served(coord) == 3 and grpc_beats(coord) == 0

        asyncio.run(scenario())
    finally:
        coord.stop()


def test_a_taken_udp_port_or_a_bad_setting_is_refused_in_one_line(tmp_path):
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        port = str(taken.getsockname()[1])
        with pytest.raises(RuntimeError, match=f"cannot receive heartbeat datagrams on UDP 127.0.0.1:{port}"):
            start_coordinator(tmp_path / "coord.db", "--heartbeat-udp", port)
    finally:
        taken.close()
    for bad in ("on", "-1", "70000"):
        with pytest.raises(SettingsError, match="heartbeat_udp must be node-port, off or a UDP port number"):
            CoordinatorSettings(heartbeat_udp=bad)


def test_a_node_heartbeats_as_datagrams_by_default_while_it_trains(tmp_path):
    """`murmur node run` as it ships, against a coordinator as it ships: its first heartbeat
    (`starting`, before its DHT forks) is gRPC and offers the datagram key, and from then on its
    heartbeats are datagrams, while it trains rounds."""
    data = small_dataset(tmp_path / "data")
    with make_testnet(tmp_path, data, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=2)
        node = net.add_node()
        wait_rounds(node, 2)
        coord = SimpleNamespace(info=net.info)
        deadline = time.monotonic() + 120.0  # a failure's bound: beats come every heartbeat interval
        while served(coord) < 3:  # three datagram heartbeats while it trains on
            assert time.monotonic() < deadline and node.proc.poll() is None, log(node)[-2000:]
            time.sleep(0.2)
        assert metric(coord, "murmur_rpc_calls", 'method="HeartbeatStream"') == 0
        assert metric(coord, "murmur_rpc_calls", 'method="Heartbeat"') >= 1  # the `starting` one
