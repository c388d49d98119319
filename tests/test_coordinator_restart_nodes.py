"""A coordinator SIGKILLed and restarted mid-run, with real node processes: nothing is lost.

A 3-node testnet trains with the coordinator as the DHT bootstrap peer (`--dht`). The coordinator
is SIGKILLed and started again on the same ledger and addresses, three times, while the nodes
train. No node loses its lease or its membership, no commit trained under a valid lease is
refused, and a node restarted afterwards (from its saved join record and bootstrap peers) rejoins
and trains rounds again. The coordinator's counters and events are read through `murmur admin`."""

from __future__ import annotations

import re
import signal

import pytest
from _node_helpers import ledger, log, make_testnet, small_dataset, trained, wait_log, wait_rounds

pytestmark = pytest.mark.slow

RESTARTS = 3
# The grace outlasts the time nodes need to see the coordinator back; the TTLs are short, so a
# lease lost to an outage would show within the test.
COORDINATOR = ["--dht", "--heartbeat-ttl", "4", "--lease-ttl", "6", "--restart-grace", "20"]
NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "10", "--round-timeout", "60", "--dht-record-ttl", "8"]


def _events(net) -> list[dict]:
    return net.admin("events", "--run", net.run_id, "--limit", "5000")["events"]


def test_three_coordinator_restarts_lose_no_lease_and_a_restarted_node_rejoins(tmp_path):
    data = small_dataset(tmp_path / "data")
    net = make_testnet(tmp_path / "net", data, overrides=["train.steps=100000"], node_args=NODE)
    net.coordinator_args = list(COORDINATOR)
    with net:
        net.start_coordinator()
        assert net.info.get("dht"), net.info
        net.create_run(token_uses=8)
        for _ in range(3):
            net.add_node(extra=["--min-peers", "3"])
        for node in net.nodes:
            wait_rounds(node, 2, timeout_s=300)
        for _ in range(RESTARTS):
            marks = [len(trained(n)) for n in net.nodes]
            address = str(net.info["address"])
            net.kill_coordinator()
            net.stop_coordinator()  # closes its log; it is dead already
            net.start_coordinator(address)
            # Training went on through the outage and goes on after it: two more rounds each.
            for node, mark in zip(net.nodes, marks, strict=True):
                wait_rounds(node, mark + 2, timeout_s=300)
        # Every node's commits reach the ledger: none pending, none refused.
        for node in net.nodes:
            wait_log(node, r"coordinator is back", timeout_s=60)
        events = _events(net)
        kinds = [e["kind"] for e in events]
        assert kinds.count("coordinator_started") == RESTARTS + 1, kinds
        assert "lost" not in kinds and "lease_expired" not in kinds, [e for e in events if e["kind"] != "commit"]
        assert "commit_refused" not in kinds, [e for e in events if e["kind"] == "commit_refused"]
        for node in net.nodes:
            assert not re.search(r"commit of shard .* refused", log(node)), log(node)[-3000:]
        nodes = net.admin("nodes", "list", "--run", net.run_id)["nodes"]
        assert {n["status"] for n in nodes} == {"active"}, nodes

        # A node restarted after the restarts rejoins from its saved join record and trains again.
        # (It is down longer than the heartbeat TTL, so its own lease may expire meanwhile.)
        restarted = net.nodes[2]
        restarted_id = trained(restarted)[-1]["node"]
        after = max(e["seq"] for e in _events(net))
        net.kill_node(restarted)
        mark = len(trained(restarted))
        net.start_node(restarted, ["--min-peers", "1"])
        wait_log(restarted, r"rejoining run", timeout_s=60)
        wait_rounds(restarted, mark + 2, timeout_s=300)
        assert "joined run" not in log(restarted).split("rejoining run")[-1]  # the same membership

        for node in net.nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in net.nodes:
            assert node.proc.wait(60) == 0, log(node)[-3000:]
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total  # every committed token counted exactly once
        others = [e for e in _events(net) if int(e["seq"]) > int(after) and e.get("node_id") != restarted_id]
        assert not [e for e in others if e["kind"] in ("commit_refused", "lease_expired", "lost")], others
