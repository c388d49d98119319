"""Joining, leases and commits against a real coordinator process, through the member client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from _coordinator_helpers import FAST, admin, admin_json, join, new_token, start_coordinator, write_run_files

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import coordinator_pb2_grpc as pb_grpc
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run
from murmur.protocol.jointoken import JoinToken, JoinTokenError, fetch_pinned_ca

pytestmark = pytest.mark.integration


@pytest.fixture
def coord(tmp_path):
    c = start_coordinator(tmp_path / "coord.db", *FAST)
    try:
        config, manifest = write_run_files(tmp_path, [1000, 600])
        created = admin(c, "runs", "create", "--config", str(config), "--manifest", str(manifest))
        assert created.returncode == 0, created.stderr
        yield c
    finally:
        c.stop()


def test_expired_or_revoked_token_cannot_join(coord):
    expired = new_token(coord, "--ttl", "1")  # one second
    revoked = admin_json(coord, "tokens", "create")
    assert admin(coord, "tokens", "revoke", revoked["info"]["token_id"]).returncode == 0

    async def scenario() -> None:
        await asyncio.sleep(1.2)  # let the one-second token age: this is the condition under test
        with pytest.raises(CoordinatorError, match="has expired") as err:
            await join_run(coord.address, expired, identity.generate_key())
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(CoordinatorError, match="was revoked"):
            await join_run(coord.address, revoked["token"], identity.generate_key())
        once = new_token(coord)
        await join_run(coord.address, once, identity.generate_key())
        with pytest.raises(CoordinatorError, match="used up"):
            await join_run(coord.address, once, identity.generate_key())
        # a token whose secret was tampered with
        t = JoinToken.parse(once)
        with pytest.raises(CoordinatorError, match="not valid for this coordinator"):
            await join_run(
                coord.address, str(JoinToken(t.token_id, "y" * 32, t.ca_fingerprint)), identity.generate_key()
            )

    asyncio.run(scenario())
    assert admin_json(coord, "nodes", "list")["nodes"].__len__() == 1


def test_token_pins_the_coordinator_ca(coord):
    token = JoinToken.parse(new_token(coord))
    with pytest.raises(JoinTokenError, match="not the coordinator this token was made for"):
        fetch_pinned_ca(coord.address, "0" * 64)
    assert b"BEGIN CERTIFICATE" in fetch_pinned_ca(coord.address, token.ca_fingerprint)
    with pytest.raises(JoinTokenError, match="not a murmur join token"):
        JoinToken.parse("hello")


def test_forged_certificates_are_refused(coord):
    token = new_token(coord)

    async def scenario() -> None:
        real, info = await join_run(coord.address, token, identity.generate_key())
        # a certificate from another CA (self-made) for a fresh key: the TLS handshake refuses it
        forged = identity.CertificateAuthority.create("evil").issue()
        forged = identity.Identity(key=forged.key, cert_pem=forged.cert_pem, ca_cert_pem=real.ca_cert_pem)
        async with MemberClient(info.node_address, forged, timeout_s=5) as client:
            with pytest.raises(CoordinatorError) as err:
                await client.heartbeat()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # the real node's certificate with another key: the handshake fails too
        stolen = identity.Identity(key=identity.generate_key(), cert_pem=real.cert_pem, ca_cert_pem=real.ca_cert_pem)
        async with MemberClient(info.node_address, stolen, timeout_s=5) as client:
            with pytest.raises(CoordinatorError):
                await client.heartbeat()
        # a member call on the public address, where no client certificate is presented
        public = identity.Identity(key=real.key, cert_pem=real.cert_pem, ca_cert_pem=real.ca_cert_pem)
        async with MemberClient(coord.address, public, timeout_s=5) as client:
            with pytest.raises(CoordinatorError, match="need the node certificate") as err:
                await client.heartbeat()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        # and the real one works
        async with MemberClient(info.node_address, real) as client:
            assert (await client.heartbeat()).run_state == "active"

    asyncio.run(scenario())


def test_silent_node_loses_its_lease_and_its_late_commit_is_refused(coord):
    token = new_token(coord, "--uses", "2")

    async def scenario() -> None:
        a, a_id = await join(coord, token)
        b, b_id = await join(coord, token)
        async with a, b:
            la = (await a.acquire()).lease
            await a.commit(la.lease_id, la.shard_id, 0, 300, outer_step=1, loss=3.0)
            # a goes silent; b heartbeats and asks until it is handed a's shard
            lb = (await b.acquire()).lease
            assert lb.shard_id != la.shard_id
            await b.commit(lb.lease_id, lb.shard_id, 0, lb.end_offset, outer_step=1, loss=3.0)  # finish it
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                await b.heartbeat()
                reply = await b.acquire()
                if reply.granted:
                    break
                assert asyncio.get_running_loop().time() < deadline, "a's lease never expired"
                await asyncio.sleep(0.1)
            lb2 = reply.lease
            assert (lb2.shard_id, lb2.start_offset) == (la.shard_id, 300)  # from the committed offset
            with pytest.raises(CoordinatorError, match="no longer yours") as err:
                await a.commit(la.lease_id, la.shard_id, 300, 700, outer_step=2, loss=2.0)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            done = await b.commit(lb2.lease_id, lb2.shard_id, 300, lb2.end_offset, outer_step=2, loss=2.0)
            assert done.shard_done
            assert not (await b.acquire()).granted

    asyncio.run(scenario())
    shards = admin_json(coord, "shards", "list")["shards"]
    assert all(s["done"] for s in shards)
    assert sum(int(s["committed_offset"]) for s in shards) == 1600
    assert admin_json(coord, "status")["run"]["tokens_committed"] == 1600  # every token exactly once
    kinds = [e["kind"] for e in admin_json(coord, "events", "--limit", "500")["events"]]
    assert "lost" in kinds and "lease_expired" in kinds


def test_an_exhausted_lease_stays_held_beside_a_new_one_until_the_window_commits_it(coord):
    """A shard that runs out mid-window is committed with the window's round (its tokens count
    only if the round completes): meanwhile the node names it exhausted and gets another shard."""
    token = new_token(coord)

    async def scenario() -> int:
        a, _ = await join(coord, token)
        async with a:
            first = (await a.acquire()).lease
            again = (await a.acquire()).lease
            assert again.lease_id == first.lease_id  # a held lease is handed back
            second = (await a.acquire(exhausted=[first.lease_id])).lease
            assert second.shard_id != first.shard_id
            assert (await a.acquire()).lease.lease_id in {first.lease_id, second.lease_id}
            # The window's round completed: both commits count, the exhausted one ends its shard.
            done = await a.commit(first.lease_id, first.shard_id, 0, first.end_offset, outer_step=1, loss=3.0)
            assert done.shard_done
            await a.commit(second.lease_id, second.shard_id, 0, 100, outer_step=1, loss=3.0)
            assert (await a.acquire()).lease.lease_id == second.lease_id
            return int(first.end_offset) + 100

    committed = asyncio.run(scenario())
    assert admin_json(coord, "status")["run"]["tokens_committed"] == committed


def test_a_splits_commit_is_refused_as_aborted_so_the_node_re_syncs(coord):
    """A commit of a round completed by a minority of the live trainers is a split's: refused with
    ABORTED (the node takes the run's state again, node/daemon/resync.py), not with a lost lease's
    FAILED_PRECONDITION (the node only takes a new lease)."""
    token = new_token(coord, "--uses", "3")

    async def scenario() -> None:
        members = [await join(coord, token) for _ in range(3)]
        clients = [c for c, _ in members]
        ids = [n for _, n in members]

        async def beat() -> None:
            for i, c in enumerate(clients):
                await c.heartbeat(peer=pb.HeartbeatRequest(
                    incarnation=f"inc{i}", peer_address=f"127.0.0.1:{1000 + i}", round=3, state_hash="ab"
                ))

        try:
            loop = asyncio.get_running_loop()
            settled = loop.time() + 2 * 1.5 + 0.5  # trainers count against a commit once settled (2 TTLs)
            while loop.time() < settled:
                await beat()
                await asyncio.sleep(0.2)
            lease = (await clients[0].acquire()).lease
            with pytest.raises(CoordinatorError, match="minority group is a split") as err:
                await clients[0].commit(lease.lease_id, lease.shard_id, 0, 100, outer_step=4, round_members=ids[:1])
            assert err.value.code == grpc.StatusCode.ABORTED
            # The same window trained by a majority group is the run's progress.
            await clients[0].commit(lease.lease_id, lease.shard_id, 0, 100, outer_step=4, round_members=ids[:2])
        finally:
            for c in clients:
                await c.close()

    asyncio.run(scenario())
    assert admin_json(coord, "status")["run"]["tokens_committed"] == 100


def test_a_round_is_granted_to_one_group_before_anyone_applies_it(coord):
    """ClaimRound: the first group the coordinator grants a round holds it; a group that shares no
    member with it, or a minority of the live trainers, is refused (ABORTED, saying why) before
    it applies anything; a group that overlaps the granted one (the same round, caught up) is
    granted. Heartbeat replies say their view is whole, an empty one included."""
    token = new_token(coord, "--uses", "3")

    async def scenario() -> None:
        members = [await join(coord, token) for _ in range(3)]
        clients = [c for c, _ in members]
        ids = [n for _, n in members]

        async def beat() -> list[pb.HeartbeatReply]:
            return [
                await c.heartbeat(peer=pb.HeartbeatRequest(
                    incarnation=f"inc{i}", peer_address=f"127.0.0.1:{1000 + i}", round=3, state_hash="ab"
                ))
                for i, c in enumerate(clients)
            ]

        try:
            loop = asyncio.get_running_loop()
            while not all(r.view_whole for r in await beat()):  # the TTL after the coordinator started
                await asyncio.sleep(0.2)
            # A claim comes right after its call: trainers that just came in count already (a
            # commit's check leaves them out for two TTLs; see the test above).
            with pytest.raises(CoordinatorError, match="minority group is a split"):
                await clients[0].claim_round(3, "diloco/0", ids[:1])
            settled = loop.time() + 2 * 1.5 + 0.5
            while loop.time() < settled:
                replies = await beat()
                await asyncio.sleep(0.2)
            assert all(r.view_whole and len(c.members(r)) == 3 for c, r in zip(clients, replies, strict=True))
            # Nothing changed since each node's previous reply: the view is not listed again
            # (coordinator/trainer_view.py); the client keeps the list its last full reply had.
            assert all(r.view_unchanged and not r.members for r in replies)
            with pytest.raises(CoordinatorError, match="minority group is a split") as err:
                await clients[0].claim_round(4, "diloco/0", ids[:1])
            assert err.value.code == grpc.StatusCode.ABORTED
            assert await clients[0].claim_round(4, "diloco/0", ids[:2]) is True
            assert await clients[1].claim_round(4, "diloco/0", ids[:2]) is True  # the same group again
            assert await clients[2].claim_round(4, "diloco/0", ids[1:]) is True  # overlaps: caught up
            with pytest.raises(CoordinatorError, match="completed by 2 other members") as err:
                await clients[2].claim_round(4, "diloco/0", ids[2:])
            assert err.value.code == grpc.StatusCode.ABORTED
            # Another key of the same round (a Streaming DiLoCo fragment) is a call of its own.
            assert await clients[2].claim_round(4, "streaming/1", ids[1:]) is True
        finally:
            for c in clients:
                await c.close()

    asyncio.run(scenario())
    refused = admin_json(coord, "events", "--kind", "round_refused")["events"]
    assert len(refused) == 3 and {e["detail"]["round"] for e in refused} == {3, 4}



def test_a_grant_names_processes_and_moves_the_runs_newest_round(coord):
    """A grant remembers its members' processes (incarnations): A gave its input to B's round and
    died; back from an older checkpoint, A is another process, and its group with C for the same
    round shares nothing with B's and is refused (by node ids it shared A and was granted: two
    states of one round). While A's restart is still starting it was in no round, so a claim
    naming A then names the process before it. And a grant makes the claimant's window round the
    run's newest (heartbeat replies' run_round), though no heartbeat reported it yet: a node behind
    it waits for that state rather than claiming the round again."""
    token = new_token(coord, "--uses", "3")

    async def scenario() -> None:
        members = [await join(coord, token) for _ in range(3)]
        clients = [c for c, _ in members]
        a, b, c = [n for _, n in members]

        async def beat(i: int, incarnation: str, address: str = "", starting: bool = False) -> pb.HeartbeatReply:
            return await clients[i].heartbeat(peer=pb.HeartbeatRequest(
                incarnation=incarnation, peer_address=address, round=3, state_hash="ab", starting=starting
            ))

        try:
            while True:  # the TTL after the coordinator started
                replies = [await beat(i, f"inc{i}", f"127.0.0.1:{1000 + i}") for i in range(3)]
                if all(r.view_whole for r in replies):
                    break
                await asyncio.sleep(0.2)
            assert replies[0].run_round == 3
            assert await clients[1].claim_round(4, "diloco/0", [a, b], run_round=4) is True
            assert (await beat(2, "inc2", "127.0.0.1:1002")).run_round == 4  # the grant, not a heartbeat
            # A dies and restarts: still starting, it has been in no round; C, caught up from B's
            # result, claims B's group, which names A's previous process: the same group.
            await beat(0, "inc0-restarted", starting=True)
            assert await clients[2].claim_round(4, "diloco/0", [a, b], run_round=4) is True
            await beat(0, "inc0-restarted", "127.0.0.1:1010")
            with pytest.raises(CoordinatorError, match="other processes of them") as err:
                await clients[0].claim_round(4, "diloco/0", [a, c], run_round=4)
            assert err.value.code == grpc.StatusCode.ABORTED
            assert await clients[0].claim_round(5, "diloco/0", [a, c], run_round=5) is True  # the next is free
        finally:
            for cl in clients:
                await cl.close()

    asyncio.run(scenario())


def test_a_lone_trainer_back_without_its_granted_round_is_granted_it_again(coord):
    """A lone trainer's round is granted and the trainer dies before that round's checkpoint: back
    from the checkpoint before it, it is the only process that could hold the round, and nobody
    does. Its heartbeat replies do not name that round as the run's newest (it would wait for a
    state nobody has), while another node's do, and its claim of the round is granted again."""
    token = new_token(coord, "--uses", "2")

    async def scenario() -> None:
        (solo, a), (other, _) = [await join(coord, token) for _ in range(2)]

        async def beat(client: MemberClient, incarnation: str, address: str = "") -> pb.HeartbeatReply:
            return await client.heartbeat(peer=pb.HeartbeatRequest(
                incarnation=incarnation, peer_address=address, round=6, state_hash="ab", starting=not address
            ))

        try:
            while not (await beat(solo, "first", "127.0.0.1:1000")).view_whole:
                await asyncio.sleep(0.2)
            assert await solo.claim_round(6, "diloco/0", [a], run_round=7) is True
            assert (await beat(other, "o1")).run_round == 7  # a node still starting: not a trainer
            assert (await beat(solo, "first", "127.0.0.1:1000")).run_round == 6
            await beat(solo, "second")  # killed, back from round 6: starting
            assert (await beat(solo, "second", "127.0.0.1:1001")).run_round == 6
            assert await solo.claim_round(6, "diloco/0", [a], run_round=7) is True
        finally:
            for cl in (solo, other):
                await cl.close()

    asyncio.run(scenario())


def test_two_nodes_back_behind_the_run_at_once_cannot_both_number_their_state_as_its_round(coord):
    """Every holder of the run's rounds past their checkpoints is gone, and two nodes come back at
    once from different checkpoints: the first to claim goes on from its state numbered as the
    run's newest round; the other is refused over the wire (ABORTED, naming the first) and takes
    that state instead. Once the first is restarted, its number is free again."""
    token = new_token(coord, "--uses", "2")

    async def scenario() -> None:
        (a, a_id), (b, _) = [await join(coord, token) for _ in range(2)]
        try:
            for client in (a, b):
                await client.heartbeat(peer=pb.HeartbeatRequest(incarnation="first", round=4, starting=True))
            await a.claim_lost_rounds(9, 4)  # each goes on from its own round-4 checkpoint
            with pytest.raises(CoordinatorError, match=f"{a_id} goes on from its own state as round 9") as err:
                await b.claim_lost_rounds(9, 4)
            assert err.value.code == grpc.StatusCode.ABORTED
            await a.heartbeat(peer=pb.HeartbeatRequest(incarnation="second", round=4, starting=True))
            await b.claim_lost_rounds(9, 4)
        finally:
            for cl in (a, b):
                await cl.close()

    asyncio.run(scenario())


def test_a_view_with_no_trainer_is_whole_and_says_so(coord):
    """A trainer that is the only one heartbeating still learns the run's newest round: the reply
    is whole with an empty list (a restarting node must not mistake it for no view at all). Not
    within the first heartbeat TTL after the coordinator started: it has not heard everyone yet."""
    token = new_token(coord, "--uses", "1")

    async def scenario() -> pb.HeartbeatReply:
        client, _ = await join(coord, token)
        try:
            for _ in range(100):  # the TTL is 1.5 s
                reply = await client.heartbeat(peer=pb.HeartbeatRequest(incarnation="a", round=-1))
                if reply.view_whole:
                    return reply
                await asyncio.sleep(0.1)
            return reply
        finally:
            await client.close()

    reply = asyncio.run(scenario())
    assert reply.view_whole and not reply.members


def test_malformed_requests_get_clear_errors_and_change_nothing(coord):
    token = new_token(coord)

    async def scenario() -> None:
        client, node_id = await join(coord, token)
        async with client:
            lease = (await client.acquire()).lease
            before = await asyncio.to_thread(admin_json, coord, "shards", "list")
            cases = [
                ((lease.lease_id, lease.shard_id, 0, lease.end_offset + 1), "must be within"),
                ((lease.lease_id, lease.shard_id, 0, 0), "must be within"),
                ((lease.lease_id, lease.shard_id, 5, 10), "committed up to 0"),
                ((lease.lease_id, 99, 0, 10), "no shard 99"),
                (("", lease.shard_id, 0, 10), "no longer yours"),
            ]
            for args, message in cases:
                with pytest.raises(CoordinatorError, match=message):
                    await client.commit(*args)
            with pytest.raises(CoordinatorError, match="finite"):
                await client.commit(lease.lease_id, lease.shard_id, 0, 10, loss=float("inf"))
            with pytest.raises(CoordinatorError, match="must not be negative"):
                await client.commit(lease.lease_id, lease.shard_id, 0, 10, bytes_sent=-1)
            with pytest.raises(CoordinatorError, match="not held by node"):
                await client.release("feedface")
            after = await asyncio.to_thread(admin_json, coord, "shards", "list")
            # Progress is what a bad call could corrupt; the lease itself may expire meanwhile on a
            # loaded machine (this test sends no heartbeats and the lease TTL is 1.5 s).
            progress = lambda listing: [(s["committed_offset"], s["done"]) for s in listing["shards"]]
            assert progress(after) == progress(before)
            assert {s["holder"] for s in after["shards"]} <= {node_id, ""}
            # a wrong protocol version is refused by name
            channel = client.channel
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Heartbeat(pb.HeartbeatRequest(), metadata=(("murmur-protocol-version", "99"),))
            assert "protocol version mismatch" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Heartbeat(pb.HeartbeatRequest())
            assert "no version" in err.value.details()

        # a join with garbage in place of the certificate request
        ca_pem = fetch_pinned_ca(coord.address, JoinToken.parse(token).ca_fingerprint)
        creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
        async with grpc.aio.secure_channel(
            coord.address, creds, options=[("grpc.ssl_target_name_override", "murmur-coordinator")]
        ) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            spare = new_token(coord)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Join(
                    pb.JoinRequest(token=spare, csr_pem=b"not a csr"), metadata=(("murmur-protocol-version", "1"),)
                )
            assert "unreadable certificate request" in err.value.details()
            # a token that is not one
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Join(
                    pb.JoinRequest(token="mrm1.garbage", csr_pem=identity.make_csr(identity.generate_key())),
                    metadata=(("murmur-protocol-version", "1"),),
                )
            assert "not a murmur join token" in err.value.details()
            # oversized messages are refused before they are read
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Join(
                    pb.JoinRequest(token=spare, csr_pem=b"x" * (5 * 1024 * 1024)),
                    metadata=(("murmur-protocol-version", "1"),),
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # the garbage did not use the spare token up
            tokens = (await asyncio.to_thread(admin_json, coord, "tokens", "list"))["tokens"]
            assert [t["uses_left"] for t in tokens] == [0, 1]

    asyncio.run(scenario())
    assert len(admin_json(coord, "nodes", "list")["nodes"]) == 1
    events = admin_json(coord, "events", "--kind", "join")["events"]
    assert len(events) == 1 and events[0]["detail"]["token"]


LOOKUP = """
import asyncio, json, sys
from murmur.protocol.dht import MurmurDHT
from murmur.protocol import identity
run_id, ca, peers = sys.argv[1], open(sys.argv[2], "rb").read(), json.loads(sys.argv[3])
dht = MurmurDHT(run_id, ca_cert_pem=ca, initial_peers=peers).start()
try:
    deadline = asyncio.get_event_loop().time() + 30
    found = []
    while not found and asyncio.get_event_loop().time() < deadline:
        found = dht.peers(role="coordinator")
    print(json.dumps([p.address for p in found]))
finally:
    dht.shutdown()
"""


def test_coordinator_is_a_dht_bootstrap_peer_and_announces_itself(tmp_path):
    c = start_coordinator(tmp_path / "coord.db", *FAST, "--dht", dht=True)
    try:
        assert c.info["dht"], c.info
        config, manifest = write_run_files(tmp_path, [100])
        assert admin(c, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(c)
        ident, info = asyncio.run(join_run(c.address, token, identity.generate_key()))
        assert info.bootstrap_peers == c.info["dht"]
        # A separate process looks the coordinator up in the DHT (hivemind's own helpers stay out of
        # this test process).
        found = subprocess.run(
            [sys.executable, "-c", LOOKUP, info.run_id, str(c.info["ca_cert_file"]), json.dumps(info.bootstrap_peers)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout.strip().splitlines()[-1]) == [c.address]
    finally:
        c.stop()
