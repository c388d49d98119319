"""A stopped run looks stopped (issue 50, item 3), with real processes and a real SIGKILL: once the
run's only node is gone (lost after the heartbeat TTL) for the stall threshold, `murmur admin
status`, /api/status and /metrics say it is stopped, and its tokens/s is zero at once. Before, 0
active nodes counted as idle, not stalled: the page said `(active)` with no banner and, 27 s after
the last node died, still showed 4,917 tokens/s. The rule itself: tests/test_coordinator_stall.py."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
from _node_helpers import UNTIL_STOPPED, make_testnet, small_dataset, wait_rounds

from murmur.node.testnet.procs import murmur_cmd, wait_for

pytestmark = pytest.mark.integration

TTL_S, STALL_S = 3.0, 2.0


def test_a_run_whose_every_node_died_shows_stopped_within_the_threshold(tmp_path):
    data = small_dataset(tmp_path)
    with make_testnet(tmp_path / "net", data, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.coordinator_args = ["--heartbeat-ttl", str(TTL_S), "--lease-ttl", "4", "--stall-after", str(STALL_S)]
        net.start_coordinator()
        net.create_run(token_uses=1)
        node = net.add_node()
        wait_rounds(node, 2)
        status = net.admin("status", "--run", net.run_id)
        assert not status["stopped"] and status["run"]["state"] == "active"
        net.kill_node(node)
        killed = time.monotonic()
        wait_for(lambda: net.admin("status", "--run", net.run_id)["stopped"], timeout_s=120,
                 what="the run to show as stopped")
        took = time.monotonic() - killed
        # Lost after the TTL, stopped the threshold after it was last heard of; the admin calls
        # that poll add their own start-up (seconds each on a loaded machine).
        assert took >= STALL_S, took
        status = net.admin("status", "--run", net.run_id)
        assert status["stalled"] and status["run"]["state"] == "active"
        assert status["stall_reason"].startswith("no active node for"), status["stall_reason"]
        assert status["tokens_per_s"] == 0 and all(n["tokens_per_s"] == 0 for n in status["nodes"])
        # The same from the page's JSON and the metrics, and the admin's screen says it in words.
        page = json.loads(urllib.request.urlopen(f"http://{net.info['metrics']}/api/status", timeout=30).read())
        assert page["status"]["stopped"] is True and page["status"]["tokens_per_s"] == 0
        metrics = urllib.request.urlopen(f"http://{net.info['metrics']}/metrics", timeout=30).read().decode()
        assert f'murmur_run_stopped{{run="{net.run_id}"}} 1.0' in metrics
        screen = subprocess.run(
            murmur_cmd("admin", "status", "--run", net.run_id, "--coordinator", str(net.info["address"]),
                       "--admin-key", str(net.info["admin_key_file"])),
            capture_output=True, text=True, timeout=120,
        )
        assert screen.returncode == 0, screen.stderr[-2000:]
        assert "STALLED" not in screen.stdout and "STOPPED (no active node for over" in screen.stdout, screen.stdout
        assert "(active, STOPPED: no active node)" in screen.stdout, screen.stdout
