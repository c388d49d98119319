"""A node's state folder belongs to one run of one coordinator: a join to another run (another id,
or the same name under another coordinator's CA) sets the old checkpoint, journal and round
records aside instead of resuming them, and says so in one line."""

from __future__ import annotations

import asyncio
import json

import pytest
from _coordinator_helpers import admin, new_token, start_coordinator, write_run_files

from murmur.node.daemon import session
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import JoinRecord, StateDir

STATE_FILES = ("checkpoint.pt", "commits.jsonl", "rounds.jsonl")


def _record(run_id: str) -> JoinRecord:
    return JoinRecord(node_id="n1", run_id=run_id, coordinator="127.0.0.1:1", node_address="127.0.0.1:2",
                      tls_server_name="c", bootstrap_peers=[], heartbeat_interval_s=1.0, heartbeat_ttl_s=3.0,
                      lease_ttl_s=4.0)


def _trained(state: StateDir, run_id: str, ca_pem: bytes) -> None:
    """What a node of ``run_id`` leaves behind: its join, a checkpoint, a journal, round records."""
    state.identity_dir.mkdir(parents=True, exist_ok=True)
    state.save_join(_record(run_id), b"cert", ca_pem, 'name = "x"\n')
    state.checkpoint_path.write_bytes(b"weights")
    state.journal_path.write_text("{}\n")
    state.rounds_path.write_text(json.dumps({"round": 40, "run": run_id}) + "\n")


def test_the_same_run_keeps_its_state_and_another_run_or_coordinator_sets_it_aside(tmp_path):
    state = StateDir(tmp_path / "node")
    _trained(state, "testnet-tiny", b"CA one")
    assert state.set_aside_other_run("testnet-tiny", b"CA one") is None  # a restart, a rejoin after a leave
    state.forget_join()  # a clean leave keeps whose state it is
    assert state.set_aside_other_run("testnet-tiny", b"CA one") is None
    aside = state.set_aside_other_run("testnet-tiny", b"CA two")  # same name, another coordinator
    assert aside is not None and aside.name.startswith("other-run-testnet-tiny-")
    assert sorted(p.name for p in aside.iterdir()) == sorted(STATE_FILES)
    assert not any((state.root / f).exists() for f in STATE_FILES)
    assert (aside / "checkpoint.pt").read_bytes() == b"weights"  # moved, not lost


def test_a_folder_from_before_run_json_is_judged_by_its_ca_and_run_records(tmp_path):
    state = StateDir(tmp_path / "node")
    _trained(state, "old-run", b"CA one")
    (state.root / "run.json").unlink()
    (state.root / "join.json").unlink()  # a clean leave: only the round records name the run
    assert state.set_aside_other_run("old-run", b"CA one") is None
    assert state.set_aside_other_run("new-run", b"CA one") is not None


@pytest.mark.integration
def test_a_join_to_another_coordinators_run_of_the_same_name_does_not_resume_its_checkpoint(tmp_path):
    """A real coordinator, a real join: the folder holds run "test-run" of another CA."""
    coord = start_coordinator(tmp_path / "coord.db")
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(coord)
        state = StateDir(tmp_path / "node")
        _trained(state, "test-run", b"another coordinator's CA")
        (state.root / "join.json").unlink()  # it left that run cleanly
        lines: list[str] = []
        info, _, _ = asyncio.run(session.join(coord.address, token, state, NodeSettings(), lines.append))
        assert info.run_id == "test-run"
        assert not state.checkpoint_path.exists()
        (said,) = [line for line in lines if "another run" in line]
        assert "set aside in" in said and "\n" not in said
        # joined now: the same run of this coordinator keeps its state from here on
        assert state.set_aside_other_run("test-run", (state.identity_dir / "ca.crt").read_bytes()) is None
    finally:
        coord.stop()
