"""Two of four trainers SIGKILLed: the survivors train on without waiting for the heartbeat TTL.

Their addresses refuse the survivors' connects at once (the kernel closed the dead processes'
sockets), but the coordinator used to list them as live trainers until their heartbeats had been
missing for ``heartbeat_ttl_s``: the two survivors were no majority of four, so their rounds
waited for it (ClaimRound and their own quorum). Now a survivor reports the refusals
(ReportGone), the coordinator dials the two addresses itself, sees them refused too, and loses
both at once (``lost`` events with reason "refused").

The TTL here is 30 s, and the deadline from the kills 15 s: without the reports no ``lost`` event
says "refused" at all, and no round of the survivors alone can come before the TTL. Real
coordinator and node processes, a real ledger file, real SIGKILLs; the waits are for rounds and
ledger events, never for a fixed time."""

from __future__ import annotations

import time

import pytest
from _node_helpers import log, make_testnet, small_dataset, trained, wait_rounds

from murmur.node.testnet.cli import LOOPBACK_NODE
from murmur.node.testnet.procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TTL_S = 30.0
COORDINATOR = ["--dht", "--heartbeat-ttl", f"{TTL_S:g}", "--lease-ttl", "6", "--restart-grace", "6"]
DEADLINE_S = TTL_S / 2  # from the second kill: the survivors' round must come well before the TTL
WAIT_S = 240.0  # four tiny nodes starting and training rounds on a loaded 2-core machine


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("gone-data"))


def node_id(node) -> str:
    return str(trained(node)[-1]["node"])


def test_two_of_four_sigkilled_are_lost_at_once_and_the_survivors_train_on(tmp_path, data):
    net = make_testnet(
        tmp_path, data, overrides=["train.steps=100000"], node_args=[*LOOPBACK_NODE, "--round-timeout", "60"]
    )
    net.coordinator_args = list(COORDINATOR)
    with net:
        net.start_coordinator()
        # The coordinator lists the live trainers to the nodes one TTL after it serves (it has
        # heard from every one of them by then); the kills must come after that, or the nodes'
        # quorum is the DHT's, not the coordinator's.
        whole_at = time.time() + TTL_S
        net.create_run(token_uses=8)
        nodes = [net.add_node(extra=["--min-peers", "4"]) for _ in range(4)]
        for node in nodes:
            wait_rounds(node, 1, timeout_s=WAIT_S)

        def four_after_whole(node) -> bool:
            return any(float(r["time"]) > whole_at + 2 and r["peers"] == 4 for r in trained(node))

        wait_for(lambda: all(map(four_after_whole, nodes)), WAIT_S + TTL_S, what="rounds of 4 with the view whole")
        survivors, victims = nodes[:2], nodes[2:]
        dead_ids = {node_id(n) for n in victims}
        net.kill_node(victims[0])
        time.sleep(0.6)  # the scenario: two kills 0.6 s apart
        net.kill_node(victims[1])
        killed_at = time.time()

        def lost_refused() -> dict[str, float]:
            events = net.admin("events", "--run", net.run_id, "--kind", "lost")["events"]
            return {e["node_id"]: float(e["at"]) for e in events if e["detail"].get("reason") == "refused"}

        def alone(node) -> list[dict]:
            """Its rounds of two after the coordinator lost both (before that, a group of two
            could be granted only while it was a majority of three: the second was still alive)."""
            return [r for r in trained(node) if float(r["time"]) > lost_at and r["peers"] == 2]

        try:
            lost = wait_for(lambda: (seen := lost_refused()).keys() >= dead_ids and seen, DEADLINE_S,
                            what="both killed nodes lost as refused")
            lost_at = max(lost[n] for n in dead_ids)
            wait_for(lambda: all(alone(n) for n in survivors), DEADLINE_S, what="a round of the two survivors")
        except Exception as err:
            tails = "\n".join(f"--- {n.name}\n{log(n)[-1500:]}" for n in survivors)
            raise AssertionError(f"{err}\n{tails}") from None
        took = max(float(alone(n)[0]["time"]) for n in survivors) - killed_at
        assert lost_at - killed_at < DEADLINE_S and took < DEADLINE_S < TTL_S
        first = {n.name: alone(n)[0] for n in survivors}
        rounds = {r["round"] for r in first.values()}
        if len(rounds) == 1:  # the same round: the same state
            assert len({r["hash"] for r in first.values()}) == 1, first
        # Nobody else was lost: the survivors are live, and no loss came from the TTL.
        events = net.admin("events", "--run", net.run_id, "--kind", "lost")["events"]
        after = [e for e in events if float(e["at"]) >= killed_at - 1]
        assert {e["node_id"] for e in after} == dead_ids, after
        print(f"both lost {lost_at - killed_at:.2f} s and the survivors' first round of two {took:.2f} s "
              f"after the second kill (TTL {TTL_S:g} s)")
