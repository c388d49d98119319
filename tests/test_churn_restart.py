"""A node restarted behind the run while every holder of the run's newer state is dead.

Seen in a chaos round at a 5 s MTBF: node C was killed after round r; A and B completed more
rounds; then A and B were killed too. C restarted from its checkpoint (round r), could fetch the
newer state from nobody, and trained round r + 1 alone from its own state; when a node holding the
run's round r + 1 came back, the two trained together from two different states, and every round
they completed had two hashes. Now:

* C's heartbeat replies say the run reached a newer round even when no trainer is live (the view
  is whole, the list empty): C waits for that state instead of training (``state_fetch_timeout_s``);
* past that wait the rounds after its own are lost with their holders: C goes on from its state
  numbered as the run's newest round, so no round number ever has two states;
* A, back with the older run state, takes C's (the run's newest) and they train on together.

Whatever C's group trains, the coordinator grants only rounds no other group completed (ClaimRound).
Real processes, real SIGKILLs; no timing assertions (the waits are for log lines and rounds)."""

from __future__ import annotations

import signal

import pytest
from _node_helpers import ledger, log, make_testnet, small_dataset, trained, wait_log, wait_rounds

from murmur.node.testnet.chaos import analyze
from murmur.node.testnet.procs import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAST_COORDINATOR = ["--dht", "--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--round-timeout", "60", "--dht-record-ttl", "6"]
WAIT_S = 240.0  # rounds of three tiny nodes on a loaded 2-core machine


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("restart-data"))


def last_round(node) -> int:
    return max((int(r["round"]) for r in trained(node)), default=0)


def test_a_restart_behind_the_run_with_its_holders_dead_never_trains_apart(tmp_path, data):
    net = make_testnet(tmp_path, data, overrides=["train.steps=5000"], node_args=FAST_NODE)
    net.coordinator_args = list(FAST_COORDINATOR)  # the coordinator is the DHT bootstrap peer
    with net:
        net.start_coordinator()
        net.create_run(token_uses=12)
        a, b, c = (net.add_node(extra=["--min-peers", "3"]) for _ in range(3))
        for node in (a, b, c):
            wait_rounds(node, 2, timeout_s=WAIT_S)
        net.kill_node(c)
        behind = last_round(c)
        wait_for(lambda: min(last_round(a), last_round(b)) >= behind + 3, WAIT_S, what="a and b to go on without c")
        net.kill_node(a)
        net.kill_node(b)
        run_at = max(last_round(a), last_round(b))
        # C comes back behind the run with nobody to take the run's state from. If the coordinator
        # heard of the run's newest round, C waits for it, gives up after 5 s and goes on numbered
        # past it; the rounds A and B completed after their last heartbeat the coordinator refuses
        # to any other group (ClaimRound), so C applies nothing there until A is back.
        since = len(log(c))
        net.start_node(c, extra=["--state-fetch-timeout", "5"])
        either = r"going on from this node's round \d+ as round \d+|refused this group's round"
        wait_log(c, either, timeout_s=WAIT_S, since=since)
        net.start_node(a)
        mark = max(last_round(a), last_round(c))

        def together() -> bool:  # a round count alone is not it: a node going on renumbered jumps past it
            return all(any(int(r["round"]) > mark and r["peers"] == 2 for r in trained(n)) for n in (a, c))

        wait_for(together, WAIT_S, what="a and c to train on together")
        for node in (a, c):
            node.proc.send_signal(signal.SIGTERM)
        for node in (a, c):
            assert node.proc.wait(60) == 0, log(node)[-3000:]
        stats = analyze(net, 0.0, 0.0)
        assert stats["hash_agreement"] and stats["split_brain_rounds"] == 0, stats
        assert not [r for r in trained(c) if behind < int(r["round"]) <= run_at], "c trained rounds the run had done"
        for node in (a, c):  # together again
            assert [r for r in trained(node) if int(r["round"]) > mark and r["peers"] == 2], trained(node)[-4:]
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total
