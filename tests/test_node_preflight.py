"""`murmur node run` checks its own device and data folder before it joins: a mistake there is one
line, spends no use of the join token and leaves no member in the coordinator's ledger."""

from __future__ import annotations

import os

import pytest
from _coordinator_helpers import CLI_TIMEOUT_S, admin, admin_json, start_coordinator, write_run_files

from murmur.node.testnet.procs import run_murmur

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preflight")
    c = start_coordinator(folder / "ledger.db")
    try:
        config, manifest = write_run_files(folder, [1000])
        assert admin(c, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--data", "{tmp}/no-such-data"], "does not exist"),
        (["--data", "{tmp}"], "has no manifest.json"),  # a folder, but not a prepared dataset
        (["--device", "cuda:64"], "cuda:64"),  # absent on any machine: no CUDA, or fewer GPUs
    ],
)
def test_bad_device_or_data_spends_no_token(coord, tmp_path, args, needle):
    created = admin_json(coord, "tokens", "create", "--uses", "1")
    token, token_id = created["token"], created["info"]["token_id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
    done = run_murmur(
        ["node", "run", "--coordinator", coord.address, "--token", token, "--state-dir", str(tmp_path / "state"),
         *[a.format(tmp=tmp_path) for a in args]],
        env=env, timeout=CLI_TIMEOUT_S,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert needle in done.stderr, done.stderr
    assert done.stdout == "", done.stdout  # no "joined run" line
    mine = [t for t in admin_json(coord, "tokens", "list")["tokens"] if t["token_id"] == token_id]
    assert [t["uses_left"] for t in mine] == [1], mine
    assert admin_json(coord, "nodes", "list")["nodes"] == []
