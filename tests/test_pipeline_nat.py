"""A stage peer behind a NAT: it serves stage 1 from its own network namespace, whose inbound
connections are dropped except on the two ports it forwards (its stage service's and its peer
server's), and advertises the host-side address, where DNAT rules send those two ports on to it.
A driver and the stage-0 peer run on the host and dial only what the coordinator hands out. The
run trains through it: microbatches committed, each once in the ledger, and the host peer's
replica of stage 1 fetched through the forwarded peer-server port.

Real processes, a real namespace and real packet drops; root, ip and iptables are needed (CI runs
as root), else this skips. Only this test's own namespace, veth pair and NAT rules (named by the
pid) are touched, and they are removed at the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from _net_helpers import REPO, python_env
from _node_helpers import ledger, make_testnet
from _pipeline_helpers import finish, free_port_pair, records, start_driver, start_run_peer, stop_all

from murmur.node.testnet.procs import start_module

pytestmark = [
    pytest.mark.system,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"),
        reason="needs root, ip and iptables for a network namespace behind a NAT",
    ),
]

TAG = os.getpid() % 10_000
NS, HOST_IF, NS_IF = f"mxpn{TAG}", f"mxph{TAG}", f"mxpi{TAG}"
SUBNET = f"10.{150 + TAG % 50}.{TAG // 50 % 250}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"
TOKENS_PER_MB = 4 * 64
STEPS = 24
PIPELINE = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=1.0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "train.batch_size=4", "train.eval_batches=2", "optim.warmup_steps=2",
    "train.eval_every=12", f"train.steps={STEPS}",
]


def _sh(*cmd: str, check: bool = True) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _dnat(port: int) -> tuple[str, ...]:
    """The host's rule that forwards HOST_IP:port into the namespace (a router's port forward);
    in OUTPUT, since the driver and the other peer dial from this host."""
    return ("-t", "nat", "OUTPUT", "-d", HOST_IP, "-p", "tcp", "--dport", str(port), "-m", "comment", "--comment",
            f"murmur-test-{NS}", "-j", "DNAT", "--to-destination", f"{NS_IP}:{port}")


@pytest.fixture(scope="module")
def nat():
    """A namespace on a veth pair: it can dial the host; of the connections into it only those to
    the two forwarded ports are let in, and the host's address forwards those two there."""
    port = free_port_pair()
    inside = ("ip", "netns", "exec", NS)
    rules: list[tuple[str, ...]] = []
    _sh("ip", "netns", "del", NS, check=False)
    try:
        _sh("ip", "netns", "add", NS)
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh(*inside, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
        _sh(*inside, "ip", "link", "set", NS_IF, "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
        for p in (port, port + 1):
            _sh(*inside, "iptables", "-A", "INPUT", "-i", NS_IF, "-p", "tcp", "--dport", str(p), "-j", "ACCEPT")
        _sh(*inside, "iptables", "-A", "INPUT", "-i", NS_IF, "-p", "tcp", "--syn", "-j", "DROP")
        for p in (port, port + 1):
            rule = _dnat(p)
            _sh("iptables", rule[0], rule[1], "-I", *rule[2:])
            rules.append(rule)
        yield list(inside), port
    finally:
        for rule in rules:
            _sh("iptables", rule[0], rule[1], "-D", *rule[2:], check=False)
        _sh("ip", "netns", "del", NS, check=False)  # takes the veth pair with it
        _sh("ip", "link", "del", HOST_IF, check=False)


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    from murmur.node.model.data import prepare

    root = tmp_path_factory.mktemp("data") / "shakespeare-byte-8k"
    prepare(root, tokenizer="byte", shard_tokens=1 << 13)
    return root


def _reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _reachable_listener(inside: list[str], port: int) -> bool:
    """Whether the host can connect to a socket listening in the namespace on ``port``."""
    code = ("import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); "
            "print('up', flush=True); time.sleep(300)")
    listener = subprocess.Popen([*inside, sys.executable, "-c", code, NS_IP, str(port)], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        return _reachable(NS_IP, port, timeout_s=2.0)
    finally:
        listener.kill()
        listener.wait()


def _ready(proc: subprocess.Popen, log) -> dict:
    while True:
        line = proc.stdout.readline()
        assert line, f"the peer behind the NAT exited: {log.read_text()[-2000:]}"
        record = json.loads(line)
        if record.get("event") == "ready":
            return record


def test_a_stage_peer_behind_a_nat_serves_its_stage_on_its_forwarded_ports(tmp_path, small_shards, nat):
    inside, port = nat
    # Everything the namespaced peer dials is on the host's side of the veth: the coordinator too.
    net = make_testnet(tmp_path / "net", small_shards, overrides=PIPELINE)
    net.coordinator_args = ["--heartbeat-ttl", "5", "--node-listen", f"{HOST_IP}:0"]
    peers, driver, behind, out = [], None, None, ""
    log = tmp_path / "behind.log"
    try:
        net.start_coordinator(listen=f"{HOST_IP}:0")
        join = (str(net.info["address"]), net.create_run(3))
        peers = [start_run_peer(tmp_path / "host-peer", join, "--host", HOST_IP, "--stage", "0")]
        with open(log, "ab") as err:
            behind = start_module(
                "murmur.node.pipeline.stage_peer_process",
                ["--coordinator", join[0], "--token", join[1], "--stage", "1", "--host", NS_IP, "--port", str(port),
                 "--advertise-host", HOST_IP, "--progress-every", "0"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=python_env(), cwd=REPO, prefix=inside,
            )
        ready = _ready(behind, log)
        # What it advertised: the host-side address, on its fixed ports.
        assert ready["address"] == f"{HOST_IP}:{port}", ready
        assert ready["state_address"] == f"{HOST_IP}:{port + 1}", ready
        # The NAT holds: the forwarded ports answer at the host-side address; its own address
        # drops a connection to any other port (a kernel's choice would be one of those).
        assert _reachable(HOST_IP, port) and _reachable(HOST_IP, port + 1)
        assert not _reachable_listener(inside, port + 2)
        listed = {p["node_id"]: p["report"] for p in net.admin("stages", "--run", net.run_id)["peers"]}
        assert listed[ready["node_id"]]["address"] == f"{HOST_IP}:{port}", listed
        assert listed[ready["node_id"]]["state_address"] == f"{HOST_IP}:{port + 1}", listed
        driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
        out = finish(driver)
        tokens, offsets, _ = ledger(net)

        def replica_of_stage_1() -> bool:  # copied from the peer server behind the NAT, through its port
            view = net.admin("stages", "--run", net.run_id)
            return any(p["report"]["replica_stage"] == 1 for p in view["peers"] if p["report"]["stage"] == 0)

        deadline = time.monotonic() + 120
        while not replica_of_stage_1():
            assert time.monotonic() < deadline, "the host peer never copied stage 1 from behind the NAT"
            time.sleep(0.5)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if behind is not None and behind.poll() is None:
            behind.send_signal(signal.SIGTERM)
            behind.communicate(timeout=60)
        stop_all(peers)
        net.stop_coordinator()
    assert driver.returncode == 0, out[-3000:]
    (done,) = records(out, "done")
    assert done["reason"] == "schedule done", done
    assert tokens == STEPS * TOKENS_PER_MB == done["committed_tokens"] == sum(offsets.values()), (tokens, done)
    # every microbatch's stage-1 hops went through the peer behind the NAT, its only peer
    assert done["hops_by_peer"].get(ready["node_id"], 0) >= STEPS, done["hops_by_peer"]
