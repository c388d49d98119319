"""A run reaches its end (issue 50, item 6), with real processes and a real SIGKILL: at a run's last
shards a node waits while the shards left are leased to others (heartbeating, out of the rounds),
takes over a shard whose holder died once its lease is back in the pool, and the run ends with
every token of every shard committed exactly once; then the node stops on the coordinator's typed
"every shard is done" (protocol/lease_status.py), never on words ("unfinished" contains "finished":
both survivors of the issue's run stopped with 14,657 tokens untrained)."""

from __future__ import annotations

import pytest
from _node_helpers import FAST_COORDINATOR, FAST_NODE, UNTIL_STOPPED, log, make_testnet

from murmur.node.testnet.procs import wait_for

pytestmark = pytest.mark.integration

END_WAIT_S = 300  # the survivor's takeover and the run's last rounds, on a loaded 2-core machine


@pytest.fixture(scope="module")
def few_shards(tmp_path_factory):
    """Four shards (4,096 x 3 + 689 tokens): two nodes run out of free shards within a minute."""
    from murmur.node.model.data import bundled_corpus, prepare

    root = tmp_path_factory.mktemp("run-end-data")
    (root / "src.txt").write_text(bundled_corpus().read_text()[:14000])
    prepare(root / "data", sources=[root / "src.txt"], shard_tokens=4096)
    return root / "data"


def test_a_node_dead_with_the_last_shard_leased_leaves_it_to_the_others_and_the_run_ends(tmp_path, few_shards):
    # Steps 10x slower (the tiny model's rounds take a fraction of a second): the last shard's
    # holder is still training it when the other node runs out and waits. --min-peers 2: neither
    # trains the run's shards alone while the other is still starting.
    node_args = [*FAST_NODE, "--state-fetch-timeout", "5", "--lease-wait", "0.5", "--fault", "slow:10@x*",
                 "--min-peers", "2"]
    with make_testnet(tmp_path, few_shards, overrides=UNTIL_STOPPED, node_args=node_args) as net:
        net.coordinator_args = list(FAST_COORDINATOR)  # heartbeat TTL 3 s, lease TTL 4 s
        net.start_coordinator()
        net.create_run(token_uses=2)
        nodes = [net.add_node(), net.add_node()]

        def waiting():
            for n in nodes:
                if not n.alive():
                    raise AssertionError(f"{n.name} exited with {n.proc.returncode}: {log(n)[-3000:]}")
                if "no shard to train" in log(n):
                    return n
            return None

        # One node runs out of shards while the other holds the last free one: it waits.
        waiter = wait_for(waiting, timeout_s=END_WAIT_S, what="a node to wait for a shard")
        holder = next(n for n in nodes if n is not waiter)
        held = [s for s in net.admin("shards", "list", "--run", net.run_id)["shards"] if s.get("holder")]
        net.kill_node(holder)  # SIGKILL, holding its lease
        assert held, "the holder held no lease when it was killed"
        # The waiter takes the dead node's shard once its lease is back in the pool, trains it to
        # the end, and stops because every shard is done: exit 0.
        assert waiter.proc.wait(END_WAIT_S) == 0, log(waiter)[-4000:]
        out = log(waiter)
        assert "a shard came free: back in the rounds" in out, out[-4000:]
        assert "nothing left to train: every shard is done" in out, out[-4000:]
        status = net.admin("status", "--run", net.run_id)
        shards = net.admin("shards", "list", "--run", net.run_id)["shards"]
        # Every shard done, each committed to its end, and the ledger's total is the dataset's:
        # a commit must start at the shard's committed offset, so each token is counted once.
        assert all(s["done"] and int(s["committed_offset"]) == int(s["tokens"]) for s in shards), shards
        assert int(status["run"]["tokens_committed"]) == sum(int(s["tokens"]) for s in shards) == 12977
        assert status["run"]["shards_done"] == status["run"]["shards_total"] == 4
