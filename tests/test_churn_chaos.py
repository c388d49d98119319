"""Chaos as a test: 4 real nodes, random SIGKILLs and restarts (node/testnet/chaos.py).

Rounds go on after every kill, every record of a round holds the same state hash (no split, no
node alone while others train), and the ledger counts every token once and no token that no
recorded round trained. No timing assertions: the waits are for events (rounds recorded), with
generous bounds for a loaded machine."""

from __future__ import annotations

import signal
import time

import pytest
from _node_helpers import log, make_testnet, small_dataset, trained, wait_rounds

from murmur.node.testnet.chaos import Chaos, analyze, round_records
from murmur.node.testnet.cli import LOOPBACK_COORDINATOR, LOOPBACK_NODE

pytestmark = [pytest.mark.system, pytest.mark.timeout(1200)]

NODES = 4
MTBF_S = 12.0
CHAOS_S = 75.0
WAIT_S = 300.0  # a few rounds of 4 tiny nodes on a loaded 2-core machine, restarts included


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("churn-data"))


def test_chaos_rounds_go_on_every_round_agrees_and_the_ledger_is_exact(tmp_path, data):
    net = make_testnet(
        tmp_path, data, overrides=["train.steps=100000"], node_args=[*LOOPBACK_NODE, "--round-timeout", "60"]
    )
    net.coordinator_args = list(LOOPBACK_COORDINATOR)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=100)
        for _ in range(NODES):
            net.add_node(extra=["--min-peers", str(NODES)])
        for node in net.nodes:
            wait_rounds(node, 1, timeout_s=WAIT_S)
        monkey = Chaos(net, MTBF_S, seed=3)
        t0 = time.time()
        while time.time() - t0 < CHAOS_S or not monkey.kills:
            monkey.tick()
            time.sleep(0.5)
        monkey.finish()
        last_kill = max(t for t, _ in monkey.kills)
        # Rounds go on after the last kill: every node, the restarted ones too, trains on with the others.
        marks = {n.name: len(trained(n)) for n in net.nodes}
        for node in net.nodes:
            wait_rounds(node, marks[node.name] + 2, timeout_s=WAIT_S)
        assert any(float(r["time"]) > last_kill for r in round_records(net))
        for node in net.nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in net.nodes:
            assert node.proc.wait(60) == 0, log(node)[-2000:]
        stats = analyze(net, t0, time.time())
        assert stats["hash_agreement"], stats
        assert stats["split_brain_rounds"] == 0, stats
        assert stats["ledger_exact"], stats
        assert stats["tokens_committed"] > 0
