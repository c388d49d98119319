"""Peers as separate processes meeting through the DHT: a SIGKILLed peer, a peer that catches up,
and a peer killed between meeting the others and sending anything.

Each peer is ``python -m murmur.node.testnet.exchange_peer_process`` with its own TLS identity;
a process of its own (tests/_dht_boot.py) runs the bootstrap DHT. Spans travel as three pipeline
chunks. Peer 3 is armed with the ``exit_midstream`` fault for round 2: halfway through streaming
its chunks it SIGKILLs itself. Peer 1 loses a reduced chunk in round 1 (a cut connection) and
must catch up from the peers that completed.
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from _net_helpers import PYTHON, REPO, p2pd_processes, python_env

from murmur.protocol.identity import CertificateAuthority

pytestmark = pytest.mark.integration
PROCESS_TIMEOUT = 280  # child start-up (torch, hivemind) on a busy 2-core machine dominates


def run_peers(tmp_path, n: int, faults: dict[int, list[str]], peer_timeout: float) -> tuple[list, list[str]]:
    """n peer processes for two rounds; (the processes, their outputs)."""
    ca = CertificateAuthority.create("kill-test")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    boot = subprocess.Popen([PYTHON, str(REPO / "tests" / "_dht_boot.py"), str(tmp_path / "ca.crt"), "kill"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=python_env(), cwd=REPO)
    ready = boot.stdout.readline().split()
    assert ready[:1] == ["ready"], f"the bootstrap DHT did not start: {ready}"
    boot_address = ready[1]
    procs = []
    try:
        for i in range(n):
            ca.issue().save(tmp_path / str(i))
            cmd = [
                PYTHON,
                "-m",
                "murmur.node.testnet.exchange_peer_process",
                "--identity",
                str(tmp_path / str(i)),
                "--run",
                "kill",
                "--bootstrap",
                boot_address,
                "--peers",
                str(n),
                "--rounds",
                "2",
                "--numel",
                "50000",
                "--codec",
                "int8",
                "--chunk-mb",
                "0.016",  # 4096 elements: spans of 12288 travel as 3 chunks
                # Generous: a loaded 2-core machine can stall a live peer for seconds, and a peer
                # dropped for slowness would make round 1 a 3-member round. The SIGKILLed peer is
                # detected from its closed connections, not by this timeout.
                "--peer-timeout",
                str(peer_timeout),
                "--round-deadline",
                "60",
                "--rendezvous-deadline",
                "150",
                *faults.get(i, []),
            ]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=python_env(), cwd=REPO))
        outputs = [p.communicate(timeout=PROCESS_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        boot.stdin.close()  # the bootstrap DHT shuts down and exits
        try:
            boot.wait(60)
        except subprocess.TimeoutExpired:
            boot.kill()
            boot.wait()
    return procs, outputs


def rounds_of(outputs: list[str]) -> list[dict[int, dict]]:
    return [{r["round"]: r for r in map(json.loads, out.splitlines()) if r["event"] == "round"} for out in outputs]


def assert_round_2_went_on_without_peer_2(procs: list, outputs: list[str], timeout: float) -> None:
    """Peer 2 was SIGKILLed in round 2: round 1 had all three, and the two survivors completed
    round 2 without it, with one hash, well inside the peer timeout."""
    assert procs[2].returncode == -signal.SIGKILL
    assert [p.returncode for p in procs[:2]] == [0, 0]
    rounds = rounds_of(outputs)
    dead = json.loads(outputs[2].splitlines()[0])["node_id"]
    assert all(rounds[i][1]["ok"] and len(rounds[i][1]["members"]) == 3 for i in range(3))
    survivors = [rounds[i][2] for i in range(2)]
    assert all(r["ok"] and dead not in r["members"] and len(r["members"]) == 2 for r in survivors), survivors
    assert len({r["hash"] for r in survivors}) == 1
    # A behaviour, not a speed: waiting out the timeout would take 40 s at least.
    assert all(r["seconds"] < timeout / 2 for r in survivors), survivors
    assert p2pd_processes() == []


def test_sigkilled_peer_mid_round_survivors_agree_and_a_lagging_peer_catches_up(tmp_path):
    faults = {1: ["--fault", "lose_result@1"], 3: ["--fault", "exit_midstream@2"]}
    procs, outputs = run_peers(tmp_path, 4, faults, peer_timeout=20)
    assert procs[3].returncode == -signal.SIGKILL
    assert [p.returncode for p in procs[:3]] == [0, 0, 0]
    rounds = rounds_of(outputs)
    ids = [json.loads(out.splitlines()[0])["node_id"] for out in outputs]
    # Round 1: all four inputs, one hash; peer 1 lost a reply and caught up from the others.
    assert all(rounds[i][1]["ok"] and len(rounds[i][1]["members"]) == 4 for i in range(4)), [r[1] for r in rounds]
    assert len({rounds[i][1]["hash"] for i in range(4)}) == 1
    assert rounds[1][1]["fetched"] is True and rounds[0][1]["fetched"] is False
    # Round 2: the killed peer's span was re-owned; the three survivors hold the same result.
    survivors = [rounds[i][2] for i in range(3)]
    assert all(r["ok"] for r in survivors), survivors
    assert len({r["hash"] for r in survivors}) == 1
    # Whether the dead peer's input made it depends on when it died: if every owner had it and its
    # own span's result reached someone before the kill, that average was complete and the others
    # caught up to it; otherwise its span was re-owned by the three survivors. Either way: one result.
    assert len({tuple(r["members"]) for r in survivors}) == 1
    if ids[3] not in survivors[0]["members"]:
        assert len(survivors[0]["members"]) == 3 and ids[3] in survivors[0]["dropped"]
    assert all(r["seconds"] < 60 for r in survivors)  # within the round deadline
    assert p2pd_processes() == []


def test_a_peer_killed_before_sending_is_dropped_at_its_refusal_not_after_the_peer_timeout(tmp_path):
    """Peer 2 meets the others for round 2, then is SIGKILLed before any of its input goes out
    (what a chaos run hit: two nodes killed just after announcing a round). No stream of it ever
    breaks, so the survivors learn of its death only when its address refuses their inputs; they
    used to wait for its own input until the peer timeout (8 s in the testnet) and only then
    retry without it. Now the refusal fails it at once: round 2 ends far inside the timeout."""
    timeout = 40.0
    procs, outputs = run_peers(tmp_path, 3, {2: ["--fault", "exit_before_input@2"]}, peer_timeout=timeout)
    assert_round_2_went_on_without_peer_2(procs, outputs, timeout)


def test_a_peer_killed_after_answering_before_its_input_went_out_is_dropped_at_its_refusal(tmp_path):
    """Peer 2 holds its round-2 streams to every owner back for 3 s (answering their calls for its
    own span meanwhile), then is SIGKILLed before any of them opens: what a peer whose headers
    wait behind a busy thread pool does. The owners' calls to it had completed and no stream of it
    ever reached them, so nothing failed on their side: they used to wait for its input until the
    peer timeout (8 s in the testnet). Now each owner dials the members whose input is missing, and
    the refusal fails peer 2 at once: round 2 ends far inside the timeout, without it."""
    timeout = 40.0
    faults = {2: ["--fault", "delay:open_input:3@2x*", "--fault", "exit_holding_input@2"]}
    procs, outputs = run_peers(tmp_path, 3, faults, peer_timeout=timeout)
    assert_round_2_went_on_without_peer_2(procs, outputs, timeout)
