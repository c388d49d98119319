"""A grouped round's phase rendezvous (node/exchange/scope.py) on a real DHT: it never waits out its
deadline for a group member whose process is dead (its address refuses a connection), and it
still waits for a live one that is slow to come."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from _net_helpers import p2pd_processes

from murmur.node.exchange.group import DHTGroup, RendezvousSettings
from murmur.node.exchange.scope import ScopedGroup
from murmur.protocol import dht as D
from murmur.protocol.identity import CertificateAuthority

pytestmark = pytest.mark.integration
DEADLINE = 60.0  # the rendezvous deadline a dead member used to cost every phase it was expected in


def _closed_port() -> int:
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        return gone.getsockname()[1]  # closed when the block ends: a connect is refused


def test_a_group_rendezvous_goes_on_without_a_member_whose_process_is_dead():
    """Group {a, b, dead} as formed: dead was killed after the round's live set was read and before
    it reached the rendezvous. a waits for b (slow, alive) and goes on without dead once its
    address refuses, instead of waiting the deadline for the third entry; a scope only guessed at
    (a column call's holders) is not watched and keeps its count."""
    ca = CertificateAuthority.create("groups-rendezvous")
    a, b, dead = ca.issue(), ca.issue(), ca.issue()
    listening = socket.socket()  # b's process: alive, it accepts a connect
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    where = {a.node_id: "127.0.0.1:1", b.node_id: f"127.0.0.1:{listening.getsockname()[1]}",
             dead.node_id: f"127.0.0.1:{_closed_port()}"}
    fast = D.DHTSettings(poll_interval=0.05)
    with listening, D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=a, settings=fast) as da:
        db = da.signing_as(b)
        group = DHTGroup(da, where[a.node_id], settings=RendezvousSettings(deadline=DEADLINE))
        scoped = ScopedGroup(group, addresses=lambda: where)
        scoped.scope(3, "update/g0of2", list(where), watch=True)
        found_dead = threading.Event()
        saw = scoped.saw_refusal

        def saw_and_tell(node_id: str, address: str, reason: str) -> bool:
            found_dead.set()
            return saw(node_id, address, reason)

        scoped.saw_refusal = saw_and_tell
        # b comes late: only once a's rendezvous found dead dead (a live member that is slow is
        # waited for: its address accepts), and a returns with b, long before its deadline.
        arrived = threading.Event()

        def b_arrives() -> None:
            assert found_dead.wait(DEADLINE)
            db.rendezvous(3, "update/g0of2", where[b.node_id], deadline=time.monotonic() + 5, expected=1)
            arrived.set()

        t0 = time.monotonic()
        threading.Thread(target=b_arrives, daemon=True).start()
        met = asyncio.run(scoped.members(3, "update/g0of2"))
        waited = time.monotonic() - t0
        assert arrived.wait(30)
        assert met == {a.node_id: where[a.node_id], b.node_id: where[b.node_id]}
        assert waited < DEADLINE / 2, f"waited {waited:.1f}s for a dead member"
        assert scoped.is_dead(dead.node_id, where[dead.node_id])
        # Its death is known from now on: the gather's rendezvous of the same round counts it out
        # at once, without dialing it again.
        found_dead.clear()
        scoped.scope(3, "update/g0of2/gather", list(where), watch=True)
        db.rendezvous(3, "update/g0of2/gather", where[b.node_id], deadline=time.monotonic() + 5, expected=1)
        t0 = time.monotonic()
        assert set(asyncio.run(scoped.members(3, "update/g0of2/gather"))) == {a.node_id, b.node_id}
        assert time.monotonic() - t0 < DEADLINE / 2 and not found_dead.is_set()
        # Not watched (a column call: which holder each group sends is not known by name): the
        # count stays its size, so a short look returns whoever is there at its end.
        scoped.scope(3, "update/c0of2", [a.node_id, dead.node_id])
        t0 = time.monotonic()
        assert set(asyncio.run(scoped.members(3, "update/c0of2", wait_s=2.0))) == {a.node_id}
        assert time.monotonic() - t0 >= 1.5, "an unwatched scope waits for its count"
    assert p2pd_processes() == []
