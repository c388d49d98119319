"""The daemon's lifecycle with real processes and real signals: a coordinator, `murmur node run`
processes, SIGTERM, SIGKILL and a coordinator restart. The node trains alone here (``--solo``: a
one-member exchange), so these tests isolate what does not depend on peers; the several-node
tests are in test_testnet.py."""

from __future__ import annotations

import re
import signal
import urllib.request

import pytest
from _node_helpers import (
    ROUND_WAIT_S,
    UNTIL_STOPPED,
    ledger,
    log,
    make_testnet,
    small_dataset,
    trained,
    wait_log,
    wait_rounds,
)

from murmur.node.daemon.round_finish import MAX_WAITING

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("node-data"))


def _committed_spans_add_up(offsets: dict[int, int], total: int) -> None:
    # Every shard starts at 0, so the committed offsets are the tokens counted per shard: their
    # sum must be the run's total (nothing counted twice, nothing lost).
    assert sum(offsets.values()) == total


def test_sigterm_commits_releases_and_leaves(tmp_path, data):
    with make_testnet(tmp_path, data, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=4)
        node = net.add_node()
        wait_rounds(node, 3)
        url = wait_log(node, r"metrics on (http://\S+)").group(1)
        with urllib.request.urlopen(url, timeout=30) as reply:  # the Prometheus endpoint
            metrics = reply.read().decode()
        done = re.search(r"^murmur_node_round\{[^}]*\} (\d+)", metrics, re.M)
        assert done and int(done.group(1)) >= 3, metrics
        assert "murmur_node_bytes_sent_total" in metrics and "murmur_node_coordinator_up" in metrics
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
        text = log(node)
        assert "released the lease" in text and "left the run" in text
        total, offsets, holders = ledger(net)
        assert not any(holders.values()), "the lease must be released on SIGTERM"
        # Every completed round was committed before the exit; the half-done window was not.
        assert total == sum(r["tokens"] for r in trained(node)) > 0
        _committed_spans_add_up(offsets, total)
        nodes = net.admin("nodes", "list", "--run", net.run_id)["nodes"]
        assert [n["status"] for n in nodes] == ["left"]


def test_sigkill_then_restart_resumes_from_checkpoint(tmp_path, data):
    with make_testnet(tmp_path, data, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=4)
        node = net.add_node()
        wait_rounds(node, 3)
        net.kill_node(node)
        before = trained(node)
        last = before[-1]["round"]
        net.start_node(node)
        m = wait_log(node, r"resumed from the local checkpoint at round (\d+)")
        resumed = int(m.group(1))
        # A round is logged (and committed) only once a checkpoint holding it is on disk, and one
        # checkpoint may cover the rounds whose own was superseded while a write ran
        # (node/daemon/round_finish.py): a kill between a write and its hand-over leaves the
        # checkpoint up to MAX_WAITING + 1 rounds past the log, never behind it.
        assert last <= resumed <= last + MAX_WAITING + 1, (last, resumed)
        wait_rounds(node, len(before) + 2)
        after = trained(node)[len(before) :]
        assert after[0]["round"] == resumed + 1  # no round repeated, none skipped
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
        total, offsets, holders = ledger(net)
        _committed_spans_add_up(offsets, total)
        assert not any(holders.values())


def test_coordinator_outage_training_goes_on_and_commits_arrive(tmp_path, byte_dataset):
    # 64K-token shards: the lease outlasts the outage (a node that needs a *new* lease while the
    # coordinator is down waits for it, by design).
    with make_testnet(tmp_path, byte_dataset.root, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=4)
        node = net.add_node()
        wait_rounds(node, 2)
        net.kill_coordinator()
        wait_log(node, "coordinator unreachable")
        during = len(trained(node))
        wait_rounds(node, during + 2)  # it keeps training while the coordinator is down
        net.start_coordinator(str(net.info["address"]))
        wait_log(node, "coordinator is back")
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
        total, offsets, _ = ledger(net)
        # Everything trained, through the outage too, reached the ledger exactly once.
        assert total == sum(r["tokens"] for r in trained(node))
        _committed_spans_add_up(offsets, total)


def test_a_round_that_completes_after_sigterm_is_committed_though_it_outlasts_the_lease(tmp_path, data):
    """SIGTERM while a round is being finished (its checkpoint written, slowly): the round is
    committed, though the commit comes long after the lease would have expired without heartbeats
    (they go on until the node closes). On a GPU node with a testnet's 6 s lease, the heartbeats
    stopped with the SIGTERM and the last round's commit was refused."""
    net = make_testnet(tmp_path, data, node_args=["--solo", "--fault", "delay:checkpoint:4@x*"])
    net.coordinator_args = ["--lease-ttl", "2", "--heartbeat-ttl", "3"]  # the least the coordinator allows
    with net:
        net.start_coordinator()
        net.create_run(token_uses=2)
        node = net.add_node()
        wait_rounds(node, 1)
        since = len(log(node))
        wait_log(node, r"injected fault: checkpoint delayed", since=since)  # the next round's
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
        text = log(node)
        assert "refused" not in text, text[-2000:]
        rounds = trained(node)
        assert len(rounds) >= 2  # the round under way when the signal came is one of them
        total, offsets, _ = ledger(net)
        assert total == sum(r["tokens"] for r in rounds) > 0
        _committed_spans_add_up(offsets, total)


def test_a_window_that_runs_out_its_shard_does_not_wait_for_earlier_checkpoints(tmp_path, data):
    """The next lease comes while an earlier round's checkpoint is still being written: the leases
    earlier windows ran out stay named as exhausted until their commits go out, so none is handed
    back meanwhile, and nothing is trained or counted twice. (Draining the round finisher first
    cost a GPU node 2-8 s each time a shard ran out.) 8K-token shards of 1280-token rounds: round 7
    runs out shard 0 while round 6's checkpoint takes 25 s."""
    delay = 25.0
    net = make_testnet(tmp_path, data, node_args=["--solo", "--fault", f"delay:checkpoint:{delay:g}@6"])
    with net:
        net.start_coordinator()
        net.create_run(token_uses=2)
        node = net.add_node()
        wait_rounds(node, 9, timeout_s=ROUND_WAIT_S + delay)
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
        rounds = trained(node)
        crossing = [r for r in rounds if len(r["shards"]) > 1]
        assert crossing and crossing[0]["round"] == 7, [(r["round"], r["shards"]) for r in rounds]
        assert crossing[0]["seconds"] < delay / 2, crossing[0]  # it did not wait out the checkpoint
        assert "refused" not in log(node)
        total, offsets, _ = ledger(net)
        assert total == sum(r["tokens"] for r in rounds) > 0
        _committed_spans_add_up(offsets, total)


def test_a_slow_model_build_does_not_silence_the_heartbeats(tmp_path, data):
    """The model is built (and a checkpoint read, the state hashed) off the daemon's event loop,
    which sends the heartbeats: a build slower than the heartbeat TTL (a large model on a slow
    machine; the testnet's tiny model took 2 s on an idle machine) does not have the node marked
    lost. Built on the loop, every testnet node under load was lost at each restart."""
    net = make_testnet(tmp_path, data, node_args=["--solo", "--fault", "delay:build_model:8"], overrides=UNTIL_STOPPED)
    # A join grace of 1 s: the node is lost 5 s after its join unless it heartbeats meanwhile.
    net.coordinator_args = ["--lease-ttl", "5", "--heartbeat-ttl", "5", "--join-grace", "1", "--restart-grace", "1"]
    with net:
        net.start_coordinator()
        net.create_run(token_uses=2)
        node = net.add_node()
        wait_log(node, r"injected fault: build_model delayed")
        wait_rounds(node, 1)
        kinds = [e["kind"] for e in net.admin("events", "--limit", "500")["events"]]
        assert "lost" not in kinds and "returned" not in kinds, kinds
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
