"""Several real nodes on loopback: the gRPC exchange, the DHT, state transfer, real signals.

Each test starts a coordinator and nodes as processes (`murmur coordinator serve`, `murmur node
run`), the way `murmur testnet up` and deploy/compose.yaml do."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys

import psutil
import pytest
from _node_helpers import hashes_by_round, ledger, log, make_testnet, small_dataset, trained, wait_log, wait_rounds

from murmur.node.daemon.state_dir import read_rounds
from murmur.node.testnet.procs import wait_for

pytestmark = pytest.mark.system

# Short coordinator deadlines, so a killed node's lease comes back within the test.
FAST_COORDINATOR = ["--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
# Rounds fail over quickly when a member dies; rendezvous waits briefly for announced peers.
FAST_NODE = [
    "--peer-timeout",
    "8",
    "--rendezvous-deadline",
    "8",
    "--round-timeout",
    "60",
    "--dht-record-ttl",
    "6",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("testnet-data"))


def _start(tmp_path, data, n, *, min_peers=None, overrides=()):
    net = make_testnet(tmp_path, data, overrides=list(overrides), node_args=FAST_NODE)
    net.coordinator_args = list(FAST_COORDINATOR)
    net.start_coordinator()
    net.create_run(token_uses=4 * n + 4)
    extra = ["--min-peers", str(min_peers or n)]
    first = net.add_node(extra=extra)
    net.wait_dht_bootstrap()
    assert first.alive(), log(first)[-2000:]
    for _ in range(n - 1):
        net.add_node(extra=extra)
    return net


def _together(nodes) -> list[int]:
    """Rounds every node recorded, each as a member of a group of all of them."""
    peers = [{r["round"]: r["peers"] for r in trained(n)} for n in nodes]
    return sorted(r for r in peers[0] if all(p.get(r) == len(nodes) for p in peers))


def test_three_nodes_learn_and_hold_the_same_state(tmp_path, data, monkeypatch):
    # Started cold, as a volunteer starts them (`python -m murmur.cli ...`): the one testnet of the
    # suite that does not fork its processes from the warm-start server (node/testnet/warm.py)
    monkeypatch.setenv("MURMUR_WARM_START", "0")
    with _start(tmp_path, data, 3) as net:
        assert all(isinstance(p, subprocess.Popen) for p in [net.coordinator, *(n.proc for n in net.nodes)])
        for node in net.nodes:
            wait_rounds(node, 6, timeout_s=240)
        # The three train together: rounds all of them recorded as a group of three. Waited for,
        # not assumed of the first rounds: on a loaded machine a round may close without its
        # slowest member's update (CI's first four rounds were pairs' on all three nodes).
        wait_for(lambda: len(_together(net.nodes)) >= 3, 240, what="three rounds trained by all three nodes together")
        for node in net.nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in net.nodes:
            assert node.proc.wait(60) == 0, log(node)[-2000:]
        by_round = hashes_by_round(net.nodes)
        common = [r for r, h in by_round.items() if len(h) == 3]
        assert len(common) >= 4
        for r in common:
            assert len(set(by_round[r].values())) == 1, f"round {r}: nodes disagree {by_round[r]}"
        # Not the last round alone: the SIGTERMs land one after another, so the last round may
        # be a pair's while the third node is already leaving.
        assert len(_together(net.nodes)) >= 3
        for r in (r for node in net.nodes for r in trained(node)):
            # A window's time splits into compute, blocked on the exchange (DiLoCo blocks at the
            # end of every window) and the rest: the parts the metrics report.
            assert r["compute_seconds"] > 0 and r["exchange_wait_seconds"] > 0, r
            assert r["compute_seconds"] + r["exchange_wait_seconds"] <= r["seconds"] * 1.001, r
        for node in net.nodes:
            vals = [r["val_loss"] for r in trained(node) if r.get("val_loss") is not None]
            assert vals and vals[-1] < 5.0  # from ~5.5 (uniform over bytes) at round 0


def test_sigkill_mid_round_others_go_on_and_the_shard_is_leased_again(tmp_path, data):
    with _start(tmp_path, data, 3) as net:
        for node in net.nodes:
            wait_rounds(node, 3, timeout_s=240)
        victim = net.nodes[2]
        victim_shards = set(trained(victim)[-1]["shards"])
        net.kill_node(victim)  # node and its DHT process and p2pd: a pulled plug
        survivors = net.nodes[:2]
        marks = [len(trained(n)) for n in survivors]
        for node, mark in zip(survivors, marks, strict=True):
            wait_rounds(node, mark + 3, timeout_s=180)
        assert {trained(n)[-1]["peers"] for n in survivors} == {2}
        # The killed node's lease expired and its shard went back to the pool from the
        # committed offset; someone holds or finished it again.
        # Awaited: warm survivors train three rounds faster than the coordinator's TTLs run out.
        def released() -> bool:
            events = net.admin("events", "--run", net.run_id, "--limit", "1000")["events"]
            return any(e["kind"] in ("lease_expired", "lost") for e in events)

        wait_for(released, 60, poll_s=1.0, what="the victim's lease to expire or the victim to be lost")
        for node in survivors:
            node.proc.send_signal(signal.SIGTERM)
        for node in survivors:
            assert node.proc.wait(60) == 0, log(node)[-2000:]
        total, offsets, _ = ledger(net)
        assert sum(offsets.values()) == total  # every committed token counted exactly once
        assert victim_shards  # it held something, which went back


def test_late_joiner_takes_the_state_from_peers(tmp_path, data):
    # Steps to spare: on a loaded machine the joiner may take a minute to start, and it must find
    # the others still training (a run that ended has no state to hand it).
    with _start(tmp_path, data, 2, min_peers=2, overrides=["train.steps=2000"]) as net:
        for node in net.nodes:
            wait_rounds(node, 3, timeout_s=240)
        joiner = net.add_node(extra=["--min-peers", "1"])
        m = wait_log(joiner, r"fetched the state of round (\d+)", timeout_s=180)
        start = int(m.group(1))
        assert start >= 3
        # It trains on from the fetched state (never from round 0), and soon its update is in a
        # round's group: the others wait for it once the coordinator lists it, and a round it
        # would train after they completed it is skipped for their newer state.
        wait_for(lambda: any(r["contributed"] for r in trained(joiner)), 180, what="the joiner to contribute")
        assert trained(joiner)[0]["round"] > start
        for node in net.nodes:
            node.proc.send_signal(signal.SIGTERM)
        for node in net.nodes:
            assert node.proc.wait(60) == 0, log(node)[-2000:]
        by_round = hashes_by_round(net.nodes)
        joined = [r for r, h in by_round.items() if len(h) == 3]
        assert joined, "the joiner never shared a round with the others"
        for r in joined:
            assert len(set(by_round[r].values())) == 1, f"round {r}: {by_round[r]}"


def test_testnet_cli_refuses_bad_input(tmp_path):
    for args, needle in (
        (["--nodes", "0"], "--nodes"),
        (["--duration", "-1"], "--duration"),
        (["--config", str(tmp_path / "missing.toml")], "does not exist"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "murmur.cli", "testnet", "up", "--out", str(tmp_path / "o"), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1
        assert needle in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_testnet_up_with_stages_brings_up_a_pipelined_run_that_trains(tmp_path, data):
    """`murmur testnet up --stages 2`: stage peers the coordinator assigns, a driver, a summary."""
    from murmur.protocol.runconfig import load_config

    config = tmp_path / "run.toml"
    cfg = load_config("configs/testnet-tiny.toml", [f'data.path="{data}"'])
    config.write_text(cfg.to_toml())
    out = tmp_path / "o"
    done = subprocess.run(
        [sys.executable, "-m", "murmur.cli", "testnet", "up", "--stages", "2", "--nodes", "2", "--config",
         str(config), "--duration", "15", "--out", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"^status page: http://127\.0\.0\.1:\d+/ ", done.stdout, re.M), done.stdout[:2000]
    summary = json.loads((out / "summary.json").read_text())
    (driver,) = summary["drivers"]
    assert driver["committed_tokens"] > 0 and driver["last_loss"] < driver["first_loss"], driver
    assert [s["peers"] for s in summary["stages"]["summary"]] == [1, 1]
    assert all(code in (0, 130) for code in summary["exit_codes"].values()), summary["exit_codes"]
    # the run lasted --duration: the testnet stopped a driver that was still training (130), one
    # that had run out of work would have exited 0 before; and it evaluated the val split on the way
    assert summary["exit_codes"]["driver-0"] == 130, summary["exit_codes"]
    assert driver["val_loss"] is not None and driver["val_step"] > 0, driver
    assert "val loss" in done.stdout, done.stdout[-2000:]
    # the stage peers checkpointed their stages at the stop: `murmur export OUT` assembles the model
    exported = subprocess.run([sys.executable, "-m", "murmur.cli", "export", str(out), "--out", str(tmp_path / "x")],
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "pipeline stages" in exported.stdout and "of 2 stages" in exported.stdout, exported.stdout
    assert json.loads((tmp_path / "x" / "config.json").read_text())["tie_word_embeddings"] is False


def test_testnet_stages_refuses_fewer_nodes_than_stages(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "murmur.cli", "testnet", "up", "--stages", "3", "--nodes", "2", "--out",
         str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1 and "every stage needs a peer" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "o").exists()  # refused before anything was made


def test_testnet_up_ends_with_the_exported_model_and_a_sample(tmp_path, data):
    """`murmur testnet up` (so `make demo`): after the summary, the newest state exported to OUT/model
    (the state the nodes agreed on) and a few lines sampled from it. The nodes stop after 40 steps,
    so the testnet ends when they are done, long before --duration."""
    out = tmp_path / "o"
    done = subprocess.run(
        [sys.executable, "-m", "murmur.cli", "testnet", "up", "--nodes", "2", "--config", "configs/testnet-tiny.toml",
         "--set", f'data.path="{data}"', "--set", "train.steps=40", "--duration", "300", "--out", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"model: {out / 'model'}" in done.stdout and "\nsample:\n  | " in done.stdout, done.stdout[-2000:]
    prov = json.loads((out / "model" / "provenance.json").read_text())
    nodes = json.loads((out / "summary.json").read_text())["nodes"]
    newest = max(nodes, key=lambda r: r["rounds"])
    assert prov["round"] == newest["rounds"] > 0 and prov["state_hash"].startswith(newest["hash"]), (prov, newest)
    assert prov["run_id"]  # the nodes left cleanly (join.json is gone): their round logs name the run
    if len({r["rounds"] for r in nodes}) == 1:  # every node's tokens went into the exported state
        assert prov["tokens_trained"] == sum(r["tokens"] for r in nodes), (prov, nodes)


def test_sigterm_stops_a_chaos_testnet_and_everything_it_started(tmp_path, data):
    """SIGTERM to `murmur testnet chaos` (a `timeout`, a service manager, a CI job's end) stops it as
    Ctrl+C does: the nodes commit and leave, the coordinator stops, and not one process it started
    (fork server, coordinator, DHT, nodes) is left running. SIGTERM's default used to end the
    testnet alone and leave them all orphaned."""
    out = tmp_path / "o"
    proc = subprocess.Popen(
        [sys.executable, "-m", "murmur.cli", "testnet", "chaos", "--nodes", "2", "--mtbf", "3600", "--config",
         "configs/testnet-tiny.toml", "--set", f'data.path="{data}"', "--duration", "600", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    family: list[psutil.Process] = []
    try:
        wait_for(lambda: any("loss" in r for i in range(2) for r in read_rounds(out / "nodes" / f"node-{i}")),
                 timeout_s=240, what="a trained round")
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
        assert "interrupted: stopping the nodes" in stdout, stdout[-2000:]
        codes = json.loads((out / "summary.json").read_text())["exit_codes"]
        assert codes["node-0"] == codes["node-1"] == 0 and codes["coordinator"] == 0, codes
        # the fork server leaves when the testnet does; the others were stopped before it returned
        _, alive = psutil.wait_procs(family, timeout=60)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert len(family) >= 4 and not alive, (len(family), [(p.pid, p.cmdline()[:4]) for p in alive])
    finally:  # a failure leaves nothing behind either
        for p in [psutil.Process(proc.pid), *family] if proc.poll() is None else family:
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.communicate()
