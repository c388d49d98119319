"""`murmur export --coordinator`: a live run's newest state, fetched from the nodes that hold it
through a reader's pass the coordinator signs, with the hash the nodes announce."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
from _coordinator_helpers import join, new_token, start_coordinator, write_run_files
from _net_helpers import PYTHON, REPO, python_env
from _node_helpers import UNTIL_STOPPED, hashes_by_round, make_testnet, small_dataset, wait_rounds

pytestmark = pytest.mark.integration
EXPORT_TIMEOUT_S = 240  # the CLI's start, the grant, a tiny model's state: seconds, minutes when loaded


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "murmur.cli", "export", *args], capture_output=True, text=True,
                          env=python_env(), cwd=REPO, timeout=EXPORT_TIMEOUT_S)


def test_a_live_run_exports_the_state_its_nodes_hold(tmp_path):
    data = small_dataset(tmp_path / "data")
    net = make_testnet(tmp_path / "net", data, overrides=UNTIL_STOPPED)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=8)
        nodes = [net.add_node(extra=["--min-peers", "2"])]
        net.wait_dht_bootstrap()
        nodes.append(net.add_node(extra=["--min-peers", "2"]))
        for node in nodes:
            wait_rounds(node, 2)
        out = tmp_path / "export"
        done = _export("--coordinator", str(net.info["address"]), "--admin-key", str(net.info["admin_key_file"]),
                       "--out", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        events = net.admin("events", "--run", net.run_id)["events"]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["source_kind"] == "live run" and prov["run_id"] == net.run_id, prov
    # the nodes recorded this hash for this round: the exported model is the run's state of then
    recorded = hashes_by_round(nodes)[prov["round"]]
    assert set(recorded.values()) == {prov["state_hash"]}, (prov, recorded)
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "config.json").is_file()
    assert any(e["kind"] == "state_read" for e in events), [e["kind"] for e in events]


def test_a_live_export_is_refused_in_one_line_without_a_state_or_the_credential(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db")
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        key = str(coord.info["admin_key_file"])
        create = ["admin", "runs", "create", "--config", str(config), "--manifest", str(manifest)]
        subprocess.run([PYTHON, "-m", "murmur.cli", *create, "--coordinator", coord.address, "--admin-key", key],
                       check=True, capture_output=True, env=python_env(), cwd=REPO, timeout=EXPORT_TIMEOUT_S)
        cases = {
            "serves a state yet": ["--admin-key", key],  # a run no node has trained a round of
            "the admin credential is wrong": ["--admin-key", str(_wrong_key(tmp_path)), "--ca-cert",
                                              str(coord.info["admin_key_file"]).removesuffix(".admin-key") + ".ca.crt"],
        }
        for says, extra in cases.items():
            out = tmp_path / "out"
            done = _export("--coordinator", coord.address, *extra, "--out", str(out))
            err = done.stderr.strip()
            assert done.returncode == 1 and err.startswith("error: ") and "\n" not in err, err
            assert says in err and not out.exists(), err
        # A run that trained a round whose holders are all gone: waiting for "a round" would not
        # help, so the line says what would (issue 51: it said so of a run that had trained 100).
        async def one_round_then_leave() -> None:
            client, _ = await join(coord, new_token(coord))
            async with client:
                lease = (await client.acquire()).lease
                await client.commit(lease.lease_id, lease.shard_id, 0, 100, outer_step=1, loss=3.0)

        asyncio.run(one_round_then_leave())
        done = _export("--coordinator", coord.address, "--admin-key", key, "--out", str(tmp_path / "out"))
        err = done.stderr.strip()
        assert done.returncode == 1 and "\n" not in err, err
        assert "trained to round 1 but no live node serves its state now: start a node of the run" in err, err
    finally:
        coord.stop()


def _wrong_key(tmp_path):
    path = tmp_path / "wrong.admin-key"
    path.write_text("not-the-key\n")
    return path
