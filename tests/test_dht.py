"""The DHT adapter: signed records, TTL expiry, rendezvous across 3 processes, no p2pd left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time

import psutil
import pytest
from _net_helpers import PYTHON, REPO, p2pd_processes, python_env

from murmur.node.daemon.run_view import RunView
from murmur.node.exchange.group import DHTGroup, RendezvousSettings
from murmur.node.exchange.start_floor import StartFloor
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import dht as D
from murmur.protocol.identity import CertificateAuthority

pytestmark = pytest.mark.integration
START_TIMEOUT = 120  # seconds for a child process to import torch/hivemind and join: the CI box is busy


@pytest.fixture()
def ca():
    return CertificateAuthority.create("dht-test")


def test_records_are_signed_expire_and_say_goodbye(ca):
    a, b = ca.issue(), ca.issue()
    fast = D.DHTSettings(record_ttl=8.0)
    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=a, settings=fast) as da:
        with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=b, initial_peers=da.addresses) as db:
            helpers = da.helper_pids + db.helper_pids
            assert da.announce(D.PeerRecord(node_id=a.node_id, address="127.0.0.1:1", role="trainer"))
            assert db.announce(D.PeerRecord(node_id=b.node_id, address="127.0.0.1:2", role="stage", stage=1))
            assert [p.node_id for p in da.peers()] == sorted([a.node_id, b.node_id])
            assert [p.address for p in da.peers(role="stage", stage=1)] == ["127.0.0.1:2"]
            # Nobody can announce for another node: b signs a record filed under a's id.
            forged = D.seal(
                b, D.peers_key("run"), a.node_id, {"address": "evil", "expires_at": D.get_dht_time() + 60}
            )
            assert not db._dht().store(D.peers_key("run"), forged, D.get_dht_time() + 60, subkey=a.node_id)
            assert {p.address for p in da.peers()} == {"127.0.0.1:1", "127.0.0.1:2"}
            # A record from another run's CA is dropped by readers too.
            other = D.MurmurDHT("run", ca_cert_pem=CertificateAuthority.create("x").cert_pem)
            other._owned, other.ca_cert_pem = db._owned, CertificateAuthority.create("y").cert_pem
            assert other._read(D.peers_key("run")) == {}
            other._owned = None
            # The goodbye removes b at once; a's record runs out after its TTL.
            db.withdraw()
            assert [p.node_id for p in da.peers()] == [a.node_id]
            deadline = time.monotonic() + 30
            while da.peers() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert da.peers() == []
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in helpers
    )
    assert p2pd_processes() == []


def test_a_rendezvous_goes_on_without_a_listed_trainer_whose_address_refuses(ca):
    """The coordinator still lists trainer b (its death is a heartbeat TTL away: 10 s by default),
    but b's process is gone: nothing listens at its address. The rendezvous dials the trainers it
    still waits for, learns that b is dead and goes on without it, instead of waiting for the
    coordinator's word or its own deadline."""
    a = ca.issue()
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]  # closed when the block ends: a connect is refused
    view = RunView(a.node_id, "ia", fresh_s=600.0)
    view.update([pb.LiveMember(node_id=a.node_id, incarnation="ia", peer_address="127.0.0.1:1", round=1),
                 pb.LiveMember(node_id="b", incarnation="ib", peer_address=f"127.0.0.1:{port}", round=1)])
    assert view.expected() == 2
    deadline = 60.0
    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=a, settings=D.DHTSettings(poll_interval=0.05)) as da:
        group = DHTGroup(da, "127.0.0.1:1", settings=RendezvousSettings(deadline=deadline), view=view)
        t0 = time.monotonic()
        assert asyncio.run(group.members(1, "k")) == {a.node_id: "127.0.0.1:1"}
        assert time.monotonic() - t0 < deadline / 2  # it did not wait the deadline out
    assert view.expected() == 1
    assert p2pd_processes() == []


def test_a_peer_that_left_a_round_no_longer_counts_at_its_rendezvous(ca):
    """A failed call takes the peer's entry out (node/exchange/rounds.py): the round's retry waits
    for it again instead of meeting its entry from the failed try."""
    a, b = ca.issue(), ca.issue()
    fast = D.DHTSettings(rendezvous_ttl=60.0, poll_interval=0.05)
    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=a, settings=fast) as da:
        with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=b, initial_peers=da.addresses, settings=fast) as db:
            soon = lambda: time.monotonic() + 5  # noqa: E731
            db.rendezvous(7, "k", "127.0.0.1:2", deadline=soon(), expected=1)
            met = da.rendezvous(7, "k", "127.0.0.1:1", deadline=soon(), expected=2)
            assert met == {a.node_id: "127.0.0.1:1", b.node_id: "127.0.0.1:2"}
            db.leave_round(7, "k")
            again = da.rendezvous(7, "k", "127.0.0.1:1", deadline=time.monotonic() + 0.5, expected=2)
            assert again == {a.node_id: "127.0.0.1:1"}
            db.rendezvous(7, "k", "127.0.0.1:3", deadline=soon(), expected=1)  # back, at a new address
            assert da.rendezvous(7, "k", "127.0.0.1:1", deadline=soon(), expected=2)[b.node_id] == "127.0.0.1:3"


def test_start_errors_are_one_line(ca):
    bad = D.MurmurDHT(
        "run",
        ca_cert_pem=ca.cert_pem,
        initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/notapeer"],
        settings=D.DHTSettings(start_timeout=20),
    )
    with pytest.raises(D.DHTError, match="could not start the DHT"):
        bad.start()
    assert p2pd_processes() == []


def _living(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.name() != "torch_shm_manager":
                out.append(p)
        except psutil.Error:
            pass
    return out


def _spawn(ident_dir, ttl, boot=None):
    args = [PYTHON, str(REPO / "tests" / "_dht_node.py"), str(ident_dir), "run", str(ttl)] + (
        [boot] if boot else []
    )
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=python_env())


def _ready(proc) -> str:
    line = proc.stdout.readline()
    assert line.startswith("ready"), f"child did not start: {line!r}"
    return line.split()[1]


def test_rendezvous_across_three_processes_and_a_dead_nodes_record_expires(ca, tmp_path):
    idents = [ca.issue() for _ in range(3)]
    for i, ident in enumerate(idents):
        ident.save(tmp_path / str(i))
    procs = []
    try:
        procs.append(_spawn(tmp_path / "0", 1.5))
        boot = _ready(procs[0])
        procs += [_spawn(tmp_path / str(i), 1.5, boot) for i in (1, 2)]
        for p in procs[1:]:
            _ready(p)
        for p in procs:
            p.stdin.write(f"rendezvous 7 3 {START_TIMEOUT}\n")
            p.stdin.flush()
        seen = [json.loads(p.stdout.readline()) for p in procs]
        assert seen == [sorted(i.node_id for i in idents)] * 3
        # SIGKILL node 2: its record stops being renewed and expires; its p2pd is reaped.
        victim = psutil.Process(procs[2].pid)
        victim_kids = victim.children(recursive=True)
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait(10)
        watcher = D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, initial_peers=[boot]).start()
        try:
            # Until the watcher, new to the DHT, sees the two live records and the dead one gone
            # (its first lookup can come back empty: that is not the expiry being checked).
            deadline = time.monotonic() + 30
            alive = {p.node_id for p in watcher.peers()}
            while alive != {idents[0].node_id, idents[1].node_id} and time.monotonic() < deadline:
                time.sleep(0.3)
                alive = {p.node_id for p in watcher.peers()}
            assert alive == {idents[0].node_id, idents[1].node_id}
        finally:
            watcher.shutdown()
        deadline = time.monotonic() + 15
        while _living(victim_kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _living(victim_kids) == []  # the DHT process and p2pd of the killed node are gone
        for p in procs[:2]:
            p.stdin.write("exit\n")
            p.stdin.flush()
            assert p.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    deadline = time.monotonic() + 15
    while p2pd_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert p2pd_processes() == []


def test_a_dht_process_killed_holding_hivemind_s_future_lock_does_not_hang_the_next_start(ca):
    """hivemind's futures share one cross-process lock with every DHT process forked after import;
    a process SIGKILLed while it holds the lock (the reaper kills what does not stop in time) must
    not leave the next DHT of this process waiting forever for its first answer."""
    import multiprocessing

    from hivemind.utils.mpfuture import MPFuture

    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem) as first:
        assert first.addresses
    holder_ready = multiprocessing.get_context("fork").Event()

    def hold_the_lock():
        MPFuture._update_lock.acquire()
        holder_ready.set()
        time.sleep(600)

    holder = multiprocessing.get_context("fork").Process(target=hold_the_lock, daemon=True)
    holder.start()
    assert holder_ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    fast = D.DHTSettings(start_timeout=30, request_timeout=10)
    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=ca.issue(), settings=fast) as second:
        assert second.addresses
        assert second.peers() == []


def test_a_restarted_bootstrap_peer_splits_the_dht_until_its_peers_dial_it_again(ca, tmp_path):
    """The coordinator's DHT (the bootstrap peer: same key, same port) restarts while A and B keep
    using the DHT; C joins through it afterwards. A and B had dropped it, and its new process
    knows only C: A and B see only each other's records, C only its own, and a rendezvous never
    meets across (a node restarted after coordinator restarts was waited for at every round).
    `reconnect` to the bootstrap peer joins the two sides again."""
    key = str(tmp_path / "x.key")
    boot_settings = D.DHTSettings(identity_path=key, record_ttl=60)
    x = D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, settings=boot_settings).start()
    boot = x.addresses
    a, b, c = ca.issue(), ca.issue(), ca.issue()
    settings = D.DHTSettings(record_ttl=60)
    nodes = {k.node_id: D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=k, initial_peers=boot, settings=settings)
             for k in (a, b)}
    try:
        for n in nodes.values():
            n.start()

        def announce(*ids: str) -> None:
            for i in ids:
                nodes[i].announce(D.PeerRecord(node_id=i, address=f"127.0.0.1:{sorted(nodes).index(i) + 1}"))

        announce(a.node_id, b.node_id)
        x.shutdown()
        for _ in range(3):  # the others go on meanwhile: their calls to it fail
            announce(a.node_id, b.node_id)
        x = D.MurmurDHT("run", ca_cert_pem=ca.cert_pem,
                        settings=D.DHTSettings(identity_path=key, port=D.port_of(boot), record_ttl=60)).start()
        nodes[c.node_id] = D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=c, initial_peers=boot,
                                       settings=settings).start()
        announce(*nodes)
        assert c.node_id not in {p.node_id for p in nodes[a.node_id].peers()}, "no split: the scenario did not happen"
        # p2pd backs off dialing an address that failed (while it was down) for a few seconds:
        # the data plane dials again every few seconds, as here.
        for side in (a, c):
            deadline = time.monotonic() + 60
            while nodes[side.node_id].reconnect(boot) != 1:
                assert time.monotonic() < deadline, "the bootstrap peer never answered again"
                time.sleep(1.0)
        announce(*nodes)
        for n in nodes.values():
            assert {p.node_id for p in n.peers()} == set(nodes)
    finally:
        for n in nodes.values():
            n.shutdown()
        x.shutdown()


def test_a_start_called_off_stops_its_process_and_p2pd_at_once(ca):
    """A node told to stop while its DHT starts (issue 50): `abort_start` ends the start within a
    poll, with no DHT process or p2pd left, instead of after a whole start. The bootstrap peer here
    accepts connections (the kernel's backlog) and never answers, so the start is still waiting
    when it is called off, once its p2pd runs."""
    import threading

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        peer = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
        dht = D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, initial_peers=[peer],
                          settings=D.DHTSettings(start_timeout=START_TIMEOUT))
        outcome: list[BaseException | None] = []

        def start() -> None:
            try:
                dht.start()
                outcome.append(None)
            except BaseException as err:  # noqa: BLE001 - the test reads it
                outcome.append(err)

        before = set(psutil.Process().children())
        thread = threading.Thread(target=start)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not p2pd_processes():
            assert thread.is_alive(), outcome
            assert time.monotonic() < deadline, "no p2pd started"
            time.sleep(0.05)
        called_off = time.monotonic()
        dht.abort_start()
        thread.join(START_TIMEOUT)
        took = time.monotonic() - called_off
    assert outcome and isinstance(outcome[0], D.DHTStartAborted), outcome
    assert took < 5.0, took  # a poll, a kill and p2pd's own exit; hivemind's shutdown waits for a whole start
    assert p2pd_processes() == [] and not dht.started
    assert _living(list(set(psutil.Process().children()) - before)) == []


def test_the_peers_a_start_waited_for_are_waited_for_at_its_first_rendezvous(ca):
    """--min-peers counted B (still starting), and the run's view listed nobody but A: A's first
    rendezvous must still wait for B, not go on alone (node/exchange/start_floor.py); once they
    met, A's later rounds wait for the live trainers only."""
    a, b = ca.issue(), ca.issue()
    fast = D.DHTSettings(rendezvous_ttl=60.0, poll_interval=0.05)
    floor = StartFloor()
    floor.hold({a.node_id, b.node_id}, 2, 60.0)
    with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=a, settings=fast) as da:
        with D.MurmurDHT("run", ca_cert_pem=ca.cert_pem, identity=b, initial_peers=da.addresses, settings=fast) as db:
            group = DHTGroup(da, "127.0.0.1:1", expected=1, settings=RendezvousSettings(deadline=0.5), floor=floor)
            t0 = time.monotonic()
            assert asyncio.run(group.members(1, "k")) == {a.node_id: "127.0.0.1:1"}
            assert time.monotonic() - t0 >= 0.4  # it waited its deadline for B (expected 1 returns at once)
            assert group.fewest() == 2  # not met: the exchange's attempt does not start with one
            db.rendezvous(2, "k", "127.0.0.1:2", deadline=time.monotonic() + 5, expected=1)
            group.settings = RendezvousSettings(deadline=60.0)
            t0 = time.monotonic()
            assert asyncio.run(group.members(2, "k")) == {a.node_id: "127.0.0.1:1", b.node_id: "127.0.0.1:2"}
            assert time.monotonic() - t0 < 30.0  # met B: not the deadline
            assert group.fewest() == 1
            t0 = time.monotonic()
            assert asyncio.run(group.members(3, "k")) == {a.node_id: "127.0.0.1:1"}
            assert time.monotonic() - t0 < 30.0  # expected 1 again: no wait
