"""A node of several local ranks (`murmur node run --gpus 2`, gloo on the CPU) beside a one-rank
node: they train together with one state hash and the ledger counts each token once; a SIGKILLed
rank takes its node down cleanly (lease released, membership kept, exit non-zero) and the
node's restart resumes from its checkpoint."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from _node_helpers import hashes_by_round, ledger, log, make_testnet, small_dataset, trained, wait_log, wait_rounds

from murmur.node.testnet.procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FAST_COORDINATOR = ["--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--round-timeout", "60", "--dht-record-ttl", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("ranks-data"))


def followers(node) -> list[int]:
    """The pids of the node's follower ranks: processes of node/daemon/ranks.py on its state folder."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        line = " ".join(a.decode(errors="replace") for a in args)
        if "murmur.node.daemon.ranks" in line and f"{node.state_dir.name}/config.toml" in line:
            found.append(int(proc.name))
    return found


def test_a_two_rank_node_trains_with_a_one_rank_node_and_survives_a_killed_rank(tmp_path, data):
    # A long schedule: the one-rank node trains on while the other is down, and they meet again.
    net = make_testnet(tmp_path, data, node_args=FAST_NODE, overrides=["train.steps=100000"])
    net.coordinator_args = list(FAST_COORDINATOR)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=8)
        two = net.add_node(extra=["--min-peers", "2", "--gpus", "2"])
        net.wait_dht_bootstrap()
        one = net.add_node(extra=["--min-peers", "2"])
        wait_log(two, r"2 local ranks \(gloo\)")
        for node in (two, one):
            wait_rounds(node, 4, timeout_s=300)
        # together: one global state per round
        by_round = hashes_by_round([two, one])
        common = [r for r, h in by_round.items() if len(h) == 2]
        assert len(common) >= 3 and all(len(set(by_round[r].values())) == 1 for r in common), by_round
        # the two-rank node trains twice the rows per step: twice the tokens per round
        per_round = {n.name: {r["round"]: r["tokens"] for r in trained(n)} for n in (two, one)}
        r = common[-1]
        assert per_round[two.name][r] == 2 * per_round[one.name][r], per_round
        # SIGKILL its follower rank: the node stops cleanly, keeps its membership, exits non-zero
        (pid,) = followers(two)
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        assert two.proc.wait(120) != 0, log(two)[-3000:]
        text = log(two)
        assert "rank 1 (exit -9) of this node's 2 failed" in text, text[-3000:]
        assert "released the lease" in text and "left the run" not in text
        before = trained(two)[-1]["round"]
        # the restart resumes from its checkpoint, with its two ranks again, and trains with the other again
        restarted_at = len(trained(two))
        net.start_node(two, extra=["--gpus", "2"])
        resumed = int(wait_log(two, r"resumed from the local checkpoint at round (\d+)").group(1))
        assert resumed in (before, before + 1)

        def together_again() -> bool:
            later = {r["round"]: r["hash"] for r in trained(two)[restarted_at:]}
            theirs = {r["round"]: r["hash"] for r in trained(one)}
            both = [r for r in later if r in theirs]
            return len(both) >= 2 and all(later[r] == theirs[r] for r in both)

        wait_for(together_again, 300, what="the restarted node in the other's rounds, with one state hash")
        for node in (two, one):
            node.proc.send_signal(signal.SIGTERM)
        for node in (two, one):
            assert node.proc.wait(120) == 0, log(node)[-2000:]
        assert not followers(two)
        total, offsets, _ = ledger(net)
        # every token the ledger holds was committed once: the shards' offsets add up to it
        assert sum(offsets.values()) == total > 0
