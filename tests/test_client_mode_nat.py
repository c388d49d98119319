"""A volunteer behind a NAT: a node in its own network namespace whose inbound connections are
dropped (iptables on its side of a veth pair), beside a coordinator and two reachable nodes on the
host. The coordinator dials it back at join, it takes part in client mode (owns no span, serves no
state), and the run trains together; with --client-mode off it stops with a clear line.

Real processes, a real namespace and real packet drops; root and iptables are needed (CI runs as
root), else these tests skip. Only this test's own namespace and veth pair are touched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from _node_helpers import (
    UNTIL_STOPPED,
    hashes_by_round,
    ledger,
    log,
    make_testnet,
    small_dataset,
    trained,
    wait_log,
    wait_rounds,
)

from murmur.node.testnet.procs import TestnetError, wait_for

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"),
        reason="needs root, ip and iptables for a network namespace with dropped inbound connections",
    ),
]

TAG = os.getpid() % 10_000
NS, HOST_IF, NS_IF = f"mxnat{TAG}", f"mxh{TAG}", f"mxn{TAG}"
SUBNET = f"10.{200 + TAG % 50}.{TAG // 50 % 250}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"
FAST_COORDINATOR = ["--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--round-timeout", "60", "--dht-record-ttl", "6"]


def _sh(*cmd: str, check: bool = True) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def nat():
    """A namespace on a veth pair: it can dial the host; new TCP connections into it are dropped."""
    _sh("ip", "netns", "del", NS, check=False)
    try:
        _sh("ip", "netns", "add", NS)
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        inside = ("ip", "netns", "exec", NS)
        _sh(*inside, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
        _sh(*inside, "ip", "link", "set", NS_IF, "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
        # A home router: replies to what the node dialed get in, a SYN from outside does not.
        _sh(*inside, "iptables", "-A", "INPUT", "-i", NS_IF, "-p", "tcp", "--syn", "-j", "DROP")
        yield list(inside)
    finally:
        _sh("ip", "netns", "del", NS, check=False)  # takes the veth pair with it
        _sh("ip", "link", "del", HOST_IF, check=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("nat-data"))


def _testnet(tmp_path, data, overrides=()):
    net = make_testnet(tmp_path, data, overrides=list(overrides), node_args=FAST_NODE)
    # Everything the namespaced node dials is on the host's side of the veth.
    net.coordinator_args = [*FAST_COORDINATOR, "--dht", "--dht-listen", f"{HOST_IP}:0", "--node-listen", f"{HOST_IP}:0"]
    net.start_coordinator(listen=f"{HOST_IP}:0")
    net.create_run(token_uses=8)
    return net


def test_a_node_behind_a_nat_trains_in_client_mode_and_its_death_does_not_stop_the_round(tmp_path, data, nat):
    with _testnet(tmp_path, data, overrides=UNTIL_STOPPED) as net:
        reachable = [net.add_node(extra=["--listen", f"{HOST_IP}:0", "--min-peers", "3"]) for _ in range(2)]
        behind = net.add_node(extra=["--listen", f"{NS_IP}:0", "--min-peers", "3"], prefix=nat)
        wait_log(behind, r"taking part in client mode", timeout_s=120)
        for node in net.nodes:
            wait_rounds(node, 4, timeout_s=240)
        # Same state after every round all three shared; the client was a member of them.
        by_round = hashes_by_round(net.nodes)
        shared = [r for r, h in by_round.items() if len(h) == 3]
        assert len(shared) >= 3, by_round
        for r in shared:
            assert len(set(by_round[r].values())) == 1, f"round {r}: nodes disagree {by_round[r]}"

        # A member of a round of all three: on a loaded machine the first rounds can close before
        # the others' view names the client (it then catches up, left out), so wait for one.
        def in_a_round_of_three() -> bool:
            return any(r["peers"] == 3 and r["contributed"] for r in trained(behind))

        try:
            wait_for(in_a_round_of_three, 180, what="a round of three with the client's update in it")
        except TestnetError:
            raise AssertionError([(r["round"], r["peers"], r["contributed"]) for r in trained(behind)]) from None
        # The count comes from the coordinator's view, which a node refreshes on its own cadence:
        # on a loaded machine the first rounds can close before the view names the client.
        wait_log(reachable[0], r"peers 3 \(1 in client mode\)", timeout_s=120)
        # The operator sees who is behind a NAT; its tokens are in the ledger.
        rows = {n["node_id"]: n for n in net.admin("nodes", "list", "--run", net.run_id)["nodes"]}
        me = trained(behind)[-1]["node"]
        assert rows[me]["reachability"] == "client mode", rows[me]
        assert {rows[trained(n)[-1]["node"]]["reachability"] for n in reachable} == {"direct"}
        wait_for(lambda: int(net.admin("nodes", "show", me).get("tokens_committed", 0)) > 0, 60, what="its commits")

        # SIGKILL it: the two reachable nodes go on together, no round failing.
        marks = [len(trained(n)) for n in reachable]
        before = [len(log(n)) for n in reachable]
        net.kill_node(behind)
        for node, mark in zip(reachable, marks, strict=True):
            wait_rounds(node, mark + 3, timeout_s=180)
        assert {trained(n)[-1]["peers"] for n in reachable} == {2}
        for node, start in zip(reachable, before, strict=True):
            assert "failed (" not in log(node)[start:], log(node)[start:][-2000:]
            node.proc.send_signal(signal.SIGTERM)
        for node in reachable:
            assert node.proc.wait(60) == 0, log(node)[-2000:]
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total  # every committed token counted exactly once


def test_a_node_behind_a_nat_with_client_mode_off_stops_with_a_clear_line(tmp_path, data, nat):
    with _testnet(tmp_path, data) as net:
        node = net.add_node(extra=["--listen", f"{NS_IP}:0", "--client-mode", "off"], prefix=nat)
        assert node.proc.wait(120) != 0
        lines = [ln for ln in log(node).splitlines() if "peers cannot reach" in ln]
        assert lines and "--client-mode auto" in lines[0], log(node)[-2000:]
