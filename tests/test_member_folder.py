"""A member's folder (node/net/member_folder.py): the saved join rejoins without a token or any
call, a folder that never joined needs one, and two processes on one folder are refused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from murmur.node.daemon.state_dir import StateDir, StateDirError
from murmur.node.net.member_folder import JoinRecord, MemberFolder, MemberFolderError, join_or_rejoin
from murmur.protocol.identity import CertificateAuthority

# Nothing listens here: a join that tried the network would fail, not hang (a refused connection).
NOWHERE = "127.0.0.1:1"


def joined_folder(root) -> tuple[MemberFolder, str]:
    """A folder holding a join to NOWHERE, as a first join with a token leaves it."""
    folder = MemberFolder(root)
    ca = CertificateAuthority.create("folder-test")
    ident = ca.issue(key=folder.node_key())
    record = JoinRecord(node_id=ident.node_id, run_id="r", coordinator=NOWHERE, node_address=NOWHERE,
                        tls_server_name="murmur-coordinator")
    folder.save_join(record, ident.cert_pem, ident.ca_cert_pem, "[pipeline]\nstages = 2\n")
    return folder, ident.node_id


def test_a_saved_join_rejoins_as_the_same_node_without_a_token(tmp_path):
    folder, node_id = joined_folder(tmp_path / "f")
    said: list[str] = []
    record, ident, config = asyncio.run(join_or_rejoin(MemberFolder(tmp_path / "f"), NOWHERE, None, said.append))
    assert record.node_id == ident.node_id == node_id
    assert config == "[pipeline]\nstages = 2\n"
    assert record.join_info(config).node_id == node_id and record.join_info(config).config_toml == config
    assert said == [f"rejoining run r as {node_id} (identity from {tmp_path / 'f'})"]


def test_a_folder_without_a_join_of_this_coordinator_needs_a_token_in_one_line(tmp_path):
    with pytest.raises(MemberFolderError, match=r"holds no membership of the coordinator at 127.0.0.1:9: pass --token"):
        asyncio.run(join_or_rejoin(MemberFolder(tmp_path / "empty"), "127.0.0.1:9", "", print))
    joined_folder(tmp_path / "f")
    with pytest.raises(MemberFolderError, match="holds no membership of the coordinator at 127.0.0.1:9"):
        asyncio.run(join_or_rejoin(MemberFolder(tmp_path / "f"), "127.0.0.1:9", None, print))


def test_two_processes_on_one_folder_are_refused_and_the_state_folder_says_so_its_way(tmp_path):
    first = MemberFolder(tmp_path / "f")
    first.lock()
    try:
        with pytest.raises(MemberFolderError, match="another murmur node is running on"):
            MemberFolder(tmp_path / "f").lock()
        with pytest.raises(StateDirError):  # the daemon's folder is a member folder: its own error
            StateDir(tmp_path / "f").lock()
    finally:
        first.unlock()
    MemberFolder(tmp_path / "f").lock()  # free again


# A process that locks a folder, forks a child that lives on (as hivemind's DHT process does), and
# once the child runs (its fork handlers have run) says the child's pid; then waits to be killed.
_LOCK_AND_FORK = """
import os, sys, time
from murmur.node.net.member_folder import MemberFolder
folder = MemberFolder(sys.argv[1])
folder.lock()
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.write(w, b"1")
    time.sleep(120)
    os._exit(0)
os.read(r, 1)
print(child, flush=True)
time.sleep(120)
"""


def test_a_folder_whose_node_was_sigkilled_is_free_while_a_forked_child_of_it_lives_on(tmp_path):
    """A node's forked DHT process outlives a SIGKILL until the reaper kills it: the folder must not
    stay locked meanwhile, or the node's restart is refused as "another node"."""
    proc = subprocess.Popen([sys.executable, "-c", _LOCK_AND_FORK, str(tmp_path / "f")], stdout=subprocess.PIPE,
                            text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        with pytest.raises(MemberFolderError, match="another murmur node is running"):
            MemberFolder(tmp_path / "f").lock()  # the node itself holds it
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert open(f"/proc/{child}/stat").read().split()[2] != "Z"  # the child lives on
        MemberFolder(tmp_path / "f").lock()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
