"""ReportGone's verify path (coordinator/gone.py) on a real ledger, with real sockets.

A reported trainer is marked lost only when the coordinator's own TCP connect to the address the
trainer registered is refused: one whose address still accepts (a live or hung process) is never
marked, whoever reports it; unknown, foreign, already lost or moved peers are left alone; and one
peer is dialed at most once per ``gone_dial_every_s``. The clock is a fake one (the rate limit is
judged on it, not on how fast this machine is); the sockets are real."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest
from _coordinator_helpers import CONFIG, FAST, Clock, admin, admin_json, new_token, start_coordinator, write_run_files

from murmur.coordinator.gone import GoneReports
from murmur.coordinator.membership import Membership
from murmur.coordinator.runs import Runs
from murmur.coordinator.settings import CoordinatorSettings
from murmur.coordinator.store import Store
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run
from murmur.protocol.reachability import CLIENT_ADDRESS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ledger(tmp_path):
    clock = Clock()
    # A TTL far longer than the test: only a verified refusal can make a node lost here.
    settings = CoordinatorSettings(heartbeat_interval_s=1, heartbeat_ttl_s=600, lease_ttl_s=600)
    store = Store(tmp_path / "c.db")
    members = Membership(store, settings, identity.CertificateAuthority.create(), clock=clock)
    runs = Runs(store, settings, "ab" * 32, clock=clock)
    manifest = json.dumps({"shards": [{"id": i, "file": f"s{i}", "tokens": 1000} for i in range(4)]})
    run_id = runs.create(CONFIG, manifest)
    token = runs.create_token(run_id, 3600, 10, "").token
    yield store, members, runs, clock, run_id, token
    store.close()


def join(members: Membership, token: str) -> str:
    return members.join(token, identity.make_csr(identity.generate_key()), {"device": "cpu"}, "").node_id


def trainer(members: Membership, node_id: str, address: str, incarnation: str = "") -> None:
    members.heartbeat(node_id, 1.0, (incarnation or f"inc-{node_id[:6]}", address, 3, "ab"))


@pytest.fixture
def listening():
    """An address that accepts connections (a live, or hung, peer: nobody ever accepts here)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"127.0.0.1:{s.getsockname()[1]}", s
    s.close()


def closed_address() -> str:
    """An address whose connect is refused: a port bound and closed again (as a killed process's)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def lost_events(store: Store) -> list[dict]:
    return [{"node_id": e["node_id"], **json.loads(e["detail_json"])} for e in store.events(kind="lost")]


def test_a_refused_address_is_lost_at_once_and_a_listening_one_never(ledger, listening):
    store, members, _, clock, run_id, token = ledger
    reporter, alive, dead = (join(members, token) for _ in range(3))
    dead_address = closed_address()
    trainer(members, reporter, listening[0])
    trainer(members, alive, listening[0])
    trainer(members, dead, dead_address)
    lease, _ = members.leases.acquire(run_id, dead)
    assert lease is not None
    gone = GoneReports(members, dial_every_s=1.0, clock=clock)

    lost = asyncio.run(gone.verify(reporter, run_id, [(alive, listening[0]), (dead, dead_address)]))

    assert lost == [dead]
    assert gone.dials == 2  # each checked with a connect of the coordinator's own
    assert store.node(dead)["status"] == "lost" and store.node(alive)["status"] == "active"
    assert [n for n, _ in members.live_trainers(run_id)] == sorted([reporter, alive])
    (event,) = lost_events(store)
    assert event["node_id"] == dead and event["reason"] == "refused" and event["reported_by"] == reporter
    assert event["address"] == dead_address
    # Its in-flight work is handled as for a TTL loss: its lease went back to the pool.
    assert store.shard(run_id, lease.shard_id).holder is None
    assert [e["node_id"] for e in store.events(kind="lease_expired")] == [dead]
    assert store.check_consistency() == []

    # Reported again (another member, later): already lost, a no-op without a dial.
    clock.t += 5
    assert asyncio.run(gone.verify(alive, run_id, [(dead, dead_address)])) == [dead]
    assert gone.dials == 2 and len(lost_events(store)) == 1


def test_reports_that_cannot_evict_anyone_change_nothing(ledger, listening):
    """Unknown ids, the reporter itself, an address other than the registered one, a client-mode
    node, a node that is no trainer: no dial and no loss. A listening peer reported over and over
    is dialed at most once per period, and never lost."""
    store, members, _, clock, run_id, token = ledger
    reporter, alive, moved, client, idle = (join(members, token) for _ in range(5))
    trainer(members, reporter, listening[0])
    trainer(members, alive, listening[0])
    trainer(members, moved, listening[0])
    trainer(members, client, CLIENT_ADDRESS)
    members.heartbeat(idle, 1.0)  # a member that is not a trainer (no incarnation, no address)
    gone = GoneReports(members, dial_every_s=1.0, clock=clock)
    refused = closed_address()

    async def report(*peers: tuple[str, str]) -> list[str]:
        return await gone.verify(reporter, run_id, list(peers))

    assert asyncio.run(report(
        ("n" + "x" * 26, refused),  # nobody this coordinator knows
        (reporter, refused),  # itself
        (moved, refused),  # not the address it registered (only that one is ever dialed)
        (client, CLIENT_ADDRESS),  # a client-mode node is never dialed
        (idle, refused),  # not a trainer
    )) == []
    assert gone.dials == 0

    # A listening peer: dialed, accepted, kept. Again within the period: not dialed at all.
    assert asyncio.run(report((alive, listening[0]))) == []
    clock.t += 0.5
    assert asyncio.run(report((alive, listening[0]))) == []
    assert gone.dials == 1
    clock.t += 1.0
    assert asyncio.run(report((alive, listening[0]))) == []
    assert gone.dials == 2
    assert lost_events(store) == [] and all(store.node(n)["status"] == "active" for n in (alive, moved, client, idle))


def test_concurrent_reports_of_one_peer_share_one_dial(ledger):
    store, members, _, clock, run_id, token = ledger
    a, b, c, dead = (join(members, token) for _ in range(4))
    address = closed_address()
    trainer(members, dead, address)
    gone = GoneReports(members, dial_every_s=1.0, clock=clock)

    async def three() -> list[list[str]]:
        return list(await asyncio.gather(*(gone.verify(r, run_id, [(dead, address)]) for r in (a, b, c))))

    assert asyncio.run(three()) == [[dead]] * 3
    assert gone.dials == 1 and len(lost_events(store)) == 1


def test_a_peer_that_restarted_while_it_was_dialed_is_kept(ledger):
    """The dial was refused, but a heartbeat of a new incarnation came meanwhile: that process is
    not the dead one, and it is not marked lost."""
    store, members, _, clock, run_id, token = ledger
    reporter, peer = join(members, token), join(members, token)
    address = closed_address()
    trainer(members, peer, address, incarnation="old")

    async def restarted_during_the_dial(addr: str) -> bool:
        trainer(members, peer, address, incarnation="new")
        return True

    gone = GoneReports(members, dial_every_s=1.0, refused=restarted_during_the_dial, clock=clock)
    assert asyncio.run(gone.verify(reporter, run_id, [(peer, address)])) == []
    assert store.node(peer)["status"] == "active" and lost_events(store) == []


def test_peers_of_another_run_are_not_the_reporters_business(ledger):
    store, members, runs, clock, run_id, token = ledger
    one_shard = json.dumps({"shards": [{"id": 0, "file": "s", "tokens": 9}]})
    other_run = runs.create(CONFIG.replace('"r"', '"other"'), one_shard)
    stranger = join(members, runs.create_token(other_run, 3600, 1, "").token)
    reporter = join(members, token)
    address = closed_address()
    trainer(members, stranger, address)
    gone = GoneReports(members, dial_every_s=1.0, clock=clock)
    assert asyncio.run(gone.verify(reporter, run_id, [(stranger, address)])) == []
    assert gone.dials == 0 and store.node(stranger)["status"] == "active"



@pytest.mark.integration
def test_report_gone_over_the_wire_verifies_and_answers_with_the_new_view(tmp_path, listening):
    """A real coordinator process: ReportGone from a member loses the trainer whose address is
    closed (a `lost` event with reason "refused" in its ledger) and keeps the listening one; the
    reply lists the live trainers after that. The call needs the node certificate, like every
    member call, and a report of too many peers is refused by name."""
    coord = start_coordinator(tmp_path / "coord.db", *FAST)
    try:
        config, manifest = write_run_files(tmp_path, [1000, 600])
        assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(coord, "--uses", "3")
        dead_address = closed_address()

        async def scenario() -> pb.ReportGoneReply:
            joined = [await join_run(coord.address, token, identity.generate_key()) for _ in range(3)]
            clients = [MemberClient(i.node_address, ident, server_name=i.tls_server_name) for ident, i in joined]
            reporter, alive_id, dead_id = clients[0], joined[1][1].node_id, joined[2][1].node_id
            addresses = [listening[0], listening[0], dead_address]

            async def beat() -> list[pb.HeartbeatReply]:
                return [
                    await c.heartbeat(peer=pb.HeartbeatRequest(
                        incarnation=f"inc-{k}", peer_address=addresses[k], round=1, state_hash="ab"
                    ))
                    for k, c in enumerate(clients)
                ]

            try:
                # One heartbeat TTL after it serves, the view is whole (a reply lists it when it
                # changed since the node's last: c.members has the list either way).
                while not all(r.view_whole and len(c.members(r)) == 3 for c, r in zip(clients, await beat(),
                                                                                        strict=True)):
                    await asyncio.sleep(0.1)
                # Without the node certificate (the public address): refused like any member call.
                async with MemberClient(coord.address, joined[0][0], timeout_s=5) as public:
                    with pytest.raises(CoordinatorError, match="need the node certificate") as err:
                        await public.report_gone([(dead_id, dead_address)])
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(CoordinatorError, match="at most 64 peers") as err:
                    await reporter.report_gone([(alive_id, listening[0])] * 65)
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
                reply = await reporter.report_gone([(alive_id, listening[0]), (dead_id, dead_address)])
                assert list(reply.lost) == [dead_id]
                return reply
            finally:
                for c in clients:
                    await c.close()

        reply = asyncio.run(scenario())
        assert reply.view_whole and len(reply.members) == 2
        lost = admin_json(coord, "events", "--kind", "lost")["events"]
        assert len(lost) == 1 and lost[0]["detail"]["reason"] == "refused"
        assert lost[0]["detail"]["address"] == dead_address
    finally:
        coord.stop()
