"""A joiner that cannot see its peers' records in the DHT still never trains alone.

The fault (node/net/faults.py, armed with the node's ``--fault``) delays every lookup of peer
records past any deadline: the joiner's DHT shows nobody. It used to start "from round 0" and
train alone for the whole run while the others trained together (a split brain the coordinator
counted as progress). Now the coordinator's view of the live trainers (heartbeat replies) tells
it the run is ahead and where the state is: it fetches the state and joins the others' rounds."""

from __future__ import annotations

import signal

import pytest
from _node_helpers import UNTIL_STOPPED, ledger, log, make_testnet, small_dataset, trained, wait_log, wait_rounds

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FAST_COORDINATOR = ["--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--round-timeout", "60", "--dht-record-ttl", "6"]
BLIND = "delay:peer_lookup:3600@x*"  # every peer-record lookup outlasts its deadline


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("joiner-data"))


def test_a_joiner_blind_to_peer_records_fetches_the_state_and_never_trains_alone(tmp_path, data):
    net = make_testnet(tmp_path, data, overrides=UNTIL_STOPPED, node_args=FAST_NODE)
    net.coordinator_args = list(FAST_COORDINATOR)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=12)
        first = net.add_node(extra=["--min-peers", "2"])
        net.wait_dht_bootstrap()
        assert first.alive(), log(first)[-2000:]
        net.add_node(extra=["--min-peers", "2"])
        for node in net.nodes:
            wait_rounds(node, 3, timeout_s=240)
        joiner = net.add_node(extra=["--min-peers", "1", "--fault", BLIND])
        m = wait_log(joiner, r"fetched the state of round (\d+) .*: state hash ([0-9a-f]{12})", timeout_s=240)
        assert int(m.group(1)) >= 3
        wait_rounds(joiner, 3, timeout_s=240)
        # The hash it printed is the one the holders' round logs record for that round (issue 51).
        recorded = {r["hash"][:12] for n in net.nodes[:2] for r in trained(n) if r["round"] == int(m.group(1))}
        assert recorded == {m.group(2)}, (m.group(0), recorded)
        for node in net.nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in net.nodes:
            assert node.proc.wait(60) == 0, log(node)[-2000:]
        mine = trained(joiner)
        assert mine and all(r["peers"] >= 2 for r in mine), [(r["round"], r["peers"]) for r in mine]
        assert mine[0]["round"] > 3  # it never trained the run's early rounds again, alone
        others = {(r["round"], r["hash"]) for n in net.nodes[:2] for r in trained(n)}
        shared = [r for r in mine if any(r["round"] == o[0] for o in others)]
        assert shared, "the joiner never shared a round with the others"
        assert all((r["round"], r["hash"]) in others for r in shared)
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total
        assert "minority group" not in log(joiner)  # no commit of a round it trained apart
