"""A node builds its model and reads its checkpoint while its DHT's process starts, and a process
started warm gets no torch_shm_manager helper from its DHT: the two costs of a restart's start that
issue 51 removed (node/daemon/node.py, node/testnet/warm_preload.py)."""

from __future__ import annotations

import signal

import psutil
import pytest
from _node_helpers import UNTIL_STOPPED, log, make_testnet, small_dataset, wait_log, wait_rounds

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("overlap-data"))


def test_a_restarted_node_builds_its_model_while_its_dht_starts(tmp_path, data):
    """The build starts once the DHT's process is forked, before the DHT is ready and the peer
    server's line is logged (it started after that line, and the restart waited for both in turn).
    The build is held 2 s by a fault so its start is in the log; the node then trains and its
    restart does the same from its checkpoint."""
    hold = ["--fault", "delay:build_model:2"]
    with make_testnet(tmp_path, data, node_args=hold, overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=4)
        node, since = net.add_node(), 0
        for start in range(2):
            # One file, written line by line as things happen (the fault's line through logging,
            # the node's own through its log): the earlier line was written first.
            built = wait_log(node, r"injected fault: build_model delayed", since=since)
            plane = wait_log(node, r"peer server on ", since=since)
            assert built.start() < plane.start(), log(node)[since:]
            line = wait_log(node, r"started in [\d.]+ s \(joined at [\d.]+, data plane at [\d.]+, "
                                  r"model and checkpoint ([\d.]+) s, state at [\d.]+\)", since=since)
            assert float(line.group(1)) >= 2.0
            # hivemind's tensor-sharing default spawned this helper at every DHT start of a warm process
            helpers = [p.name() for p in psutil.Process(node.proc.pid).children(recursive=True)]
            assert "torch_shm_manager" not in helpers, helpers
            wait_rounds(node, 1 + start)
            if start == 0:
                net.kill_node(node)
                since = len(log(node))
                net.start_node(node)
        assert "resumed from the local checkpoint" in log(node)
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0, log(node)[-2000:]
