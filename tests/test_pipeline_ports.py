"""A stage peer's fixed ports, with real processes on loopback: what it binds and advertises, and a
taken port refused in one line (the stage service's or the peer server's)."""

from __future__ import annotations

import socket
import subprocess

import pytest
from _net_helpers import REPO, python_env
from _pipeline_helpers import MODEL, START_TIMEOUT, free_port_pair, start_peer, stop_peer

from murmur.node.testnet.procs import start_module
from murmur.protocol.identity import CertificateAuthority

pytestmark = pytest.mark.integration


def test_a_stage_peer_serves_and_advertises_its_fixed_ports(tmp_path):
    port = free_port_pair()
    ca = CertificateAuthority.create("ports")
    peer = start_peer(ca, tmp_path / "peer", 0, "--port", str(port), "--advertise-host", "localhost")
    try:
        # both servers on their fixed ports (the peer server on the next one), under the advertised host
        assert peer.ready["address"] == f"localhost:{port}", peer.ready
        assert peer.ready["state_address"] == f"localhost:{port + 1}", peer.ready
        for p in (port, port + 1):
            with socket.create_connection(("127.0.0.1", p), timeout=10):
                pass
    finally:
        stop_peer(peer)
    assert peer.stopped, "the stage peer did not stop cleanly"


@pytest.mark.parametrize(("which", "what"), [("--port", "the stage service"), ("--state-port", "the peer server")])
def test_a_taken_port_is_refused_in_one_line(tmp_path, which, what):
    port = free_port_pair()
    ca = CertificateAuthority.create("ports")
    ca.issue().save(tmp_path / "id")
    taken = port if which == "--port" else port + 1
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        args = ["--identity", str(tmp_path / "id"), "--run", "ports", "--stage", "0", *MODEL,
                "--port", str(port), "--state-port", str(port + 1)]
        proc = start_module("murmur.node.pipeline.stage_peer_process", args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=python_env(), cwd=REPO)
        out, err = proc.communicate(timeout=START_TIMEOUT)
    assert proc.returncode == 1, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == f"error: could not bind {what} to 127.0.0.1:{taken}: is the port taken?", err
    assert "Traceback" not in err, err
