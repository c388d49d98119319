"""`murmur admin` as a subprocess against a real coordinator process."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request

import pytest
from _coordinator_helpers import (
    FAST,
    admin,
    admin_json,
    closed_pipe_run,
    join,
    new_token,
    stalled_run,
    start_coordinator,
    write_run_files,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def coord(tmp_path):
    c = start_coordinator(tmp_path / "coord.db", *FAST)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def steady_coord(tmp_path):
    # Long TTLs: the node below must still count as active while the CLI calls run on a busy machine.
    c = start_coordinator(tmp_path / "coord.db", "--heartbeat-ttl", "120", "--lease-ttl", "120")
    try:
        yield c
    finally:
        c.stop()


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_operator_flow_run_token_join_lease_commit_status(steady_coord, tmp_path):
    coord = steady_coord
    config, manifest = write_run_files(tmp_path, [1000, 400])
    created = admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest))
    assert created.returncode == 0, created.stderr
    assert "created run test-run: 2 shards, 1400 tokens" in created.stdout
    token = new_token(coord, "--uses", "2", "--ttl", "10m", "--note", "alice")
    assert token.startswith("mrm1.") and coord.info["ca_fingerprint"] in token

    async def node_work() -> str:
        client, node_id = await join(coord, token, name="alice's laptop")
        async with client:
            hb = await client.heartbeat(tokens_per_s=1234.0)
            assert hb.run_state == "active"
            lease = (await client.acquire()).lease
            assert (lease.shard_id, lease.start_offset, lease.end_offset) == (0, 0, 1000)
            reply = await client.commit(
                lease.lease_id, lease.shard_id, 0, 250, outer_step=3, loss=2.5, bytes_sent=4096, seconds=0.5
            )
            assert reply.committed_offset == 250 and not reply.duplicate
            await client.heartbeat(tokens_per_s=1234.0)
        return node_id

    node_id = asyncio.run(node_work())

    table = admin(coord, "status")
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "run test-run (active)" in out and "250/1400 tokens" in out and "outer step 3" in out
    assert "loss 2.5000" in out and "bytes sent 4.1 KB" in out and node_id in out
    assert f"{node_id}  alice's laptop  active" in out  # the name beside the id

    status = admin_json(coord, "status")
    assert status["run"]["tokens_committed"] == 250 and status["run"]["outer_step"] == 3
    assert status["last_loss"] == 2.5 and status["bytes_sent"] == 4096 and status["tokens_per_s"] > 0
    assert status["nodes_by_status"] == {"active": 1}
    assert [(n["node_id"], n["name"]) for n in status["nodes"]] == [(node_id, "alice's laptop")]
    assert status["nodes"][0]["shards_held"] == [0] and status["nodes"][0]["tokens_per_s"] == 1234.0

    shards = admin_json(coord, "shards", "list")["shards"]
    assert [(s["shard_id"], s["committed_offset"], s["holder"]) for s in shards] == [
        (0, 250, node_id),
        (1, 0, ""),
    ]
    shown = admin_json(coord, "nodes", "show", node_id)
    assert "BEGIN CERTIFICATE" in shown["certificate_pem"] and shown["tokens_committed"] == 250
    tokens = admin_json(coord, "tokens", "list")["tokens"]
    assert tokens[0]["uses_left"] == 1 and tokens[0]["note"] == "alice"
    events = admin_json(coord, "events")["events"]
    assert {"run_created", "token_created", "join", "lease_granted"} <= {e["kind"] for e in events}
    # numbers are JSON numbers and an event's detail the JSON object it holds, not text to parse again
    assert all(isinstance(e["seq"], int) and isinstance(e["detail"], dict) for e in events), events
    assert next(e for e in events if e["kind"] == "lease_granted")["detail"]["shard"] == 0

    # `murmur admin events | head -1`: the reader goes away, the command ends quietly
    from murmur.cli import EXIT_BROKEN_PIPE

    for args in (["events"], ["status"]):
        piped = closed_pipe_run(["admin", *args, *coord.admin_args])
        assert piped.stderr == "" and piped.returncode == EXIT_BROKEN_PIPE, (args, piped.stderr)
    assert "test-run" in admin(coord, "runs", "list").stdout
    assert 'preset = "tiny"' in admin(coord, "runs", "show").stdout

    # pause/resume and revoke are admin actions in the event log
    assert "is paused" in admin(coord, "runs", "pause", "test-run").stdout
    assert admin_json(coord, "runs", "show", "test-run")["state"] == "paused"
    assert "is active" in admin(coord, "runs", "resume").stdout
    revoked = admin(coord, "tokens", "revoke", tokens[0]["token_id"])
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    kinds = [e["kind"] for e in admin_json(coord, "events", "--limit", "200")["events"]]
    assert {"run_paused", "run_active", "token_revoked"} <= set(kinds)

    body = urllib.request.urlopen(f"http://{coord.info['metrics']}/metrics", timeout=10).read().decode()
    assert 'murmur_nodes{status="active"} 1' in body and 'murmur_nodes{status="lost"} 0' in body
    assert "murmur_tokens_committed_total 250" in body and "murmur_rounds_total 1" in body
    assert 'murmur_lease_churn_total{kind="granted"} 1' in body


def test_ban_propagates_to_peers_and_unban(coord, tmp_path):
    config, manifest = write_run_files(tmp_path, [100, 100])
    assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
    token = new_token(coord, "--uses", "2")

    async def scenario() -> None:
        bad, bad_id = await join(coord, token)
        good, _ = await join(coord, token)
        async with bad, good:
            first = await good.heartbeat()
            assert first.ban_list_changed and list(first.ban_list.node_ids) == []
            assert not (await good.heartbeat()).ban_list_changed  # nothing new: nothing sent
            await bad.acquire()
            banned = await asyncio.to_thread(admin, coord, "nodes", "ban", bad_id, "--reason", "poisoned updates")
            assert banned.returncode == 0, banned.stderr
            hb = await good.heartbeat()
            assert hb.ban_list_changed and list(hb.ban_list.node_ids) == [bad_id]
            with pytest.raises(Exception, match="banned .*poisoned updates"):
                await bad.heartbeat()
            listed = await asyncio.to_thread(admin_json, coord, "nodes", "list", "--status", "banned")
            assert [n["node_id"] for n in listed["nodes"]] == [bad_id]
            shards = (await asyncio.to_thread(admin_json, coord, "shards", "list"))["shards"]
            assert all(s["holder"] == "" for s in shards)  # the banned node's lease went back
            assert (await asyncio.to_thread(admin, coord, "nodes", "unban", bad_id)).returncode == 0
            assert list((await good.ban_list()).node_ids) == []

    asyncio.run(scenario())


def test_admin_without_or_with_wrong_credential_fails_clearly(coord, tmp_path):
    no_cred = admin(coord, "runs", "list", creds=False)
    assert "needs the admin credential" in one_error_line(no_cred)
    wrong = tmp_path / "wrong.admin-key"
    wrong.write_text("not-the-secret\n")
    bad = admin(coord, "runs", "list", creds=False, env={"MURMUR_ADMIN_KEY": "not-the-secret"})
    assert "admin credential is wrong" in one_error_line(bad)
    bad_file = admin(
        None,
        "status",
        "--coordinator",
        coord.address,
        "--admin-key",
        str(wrong),
        "--ca-cert",
        str(coord.info["ca_cert_file"]),
    )
    assert "admin credential is wrong" in one_error_line(bad_file)
    missing = admin(None, "status", "--coordinator", coord.address, "--admin-key", str(tmp_path / "nope"))
    assert "cannot read the admin key file" in one_error_line(missing)


def test_unreachable_coordinator_is_one_line(tmp_path, coord):
    # A port nobody listens on: the metrics port of the coordinator speaks HTTP, not gRPC/TLS.
    result = admin(
        None,
        "status",
        "--coordinator",
        "127.0.0.1:1",
        "--admin-key",
        str(coord.info["admin_key_file"]),
        "--timeout",
        "5",
    )
    assert "cannot reach the coordinator at 127.0.0.1:1" in one_error_line(result)


def test_malformed_run_toml_and_manifest_change_nothing(coord, tmp_path):
    config, manifest = write_run_files(tmp_path, [100])
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('name = "x"\n[model]\npreset = "huge"\n')
    err = one_error_line(admin(coord, "runs", "create", "--config", str(bad_toml), "--manifest", str(manifest)))
    assert "model.preset" in err
    bad_toml.write_text("name = \n")
    assert "not valid TOML" in one_error_line(
        admin(coord, "runs", "create", "--config", str(bad_toml), "--manifest", str(manifest))
    )
    bad_manifest = tmp_path / "bad.json"
    bad_manifest.write_text(json.dumps({"shards": [{"id": 0, "tokens": "many"}]}))
    assert "'tokens' must be" in one_error_line(
        admin(coord, "runs", "create", "--config", str(config), "--manifest", str(bad_manifest))
    )
    # absurd numbers (issue 37: batch_size = 2^63-1 and steps = 2^63 went into the ledger)
    for key, value in (("batch_size", 2**63 - 1), ("steps", 2**63)):
        absurd = tmp_path / f"absurd_{key}.toml"
        absurd.write_text(re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", config.read_text()))
        err = one_error_line(admin(coord, "runs", "create", "--config", str(absurd), "--manifest", str(manifest)))
        assert f"train.{key} must be within (0, " in err, err
    no_data = tmp_path / "no_data.toml"
    no_data.write_text(config.read_text() + '[data]\npath = "nowhere/at-all"\n')
    assert "nowhere/at-all/manifest.json does not exist" in one_error_line(
        admin(coord, "runs", "create", "--config", str(no_data))
    )
    assert admin_json(coord, "runs", "list") == {"runs": []}
    assert [e["kind"] for e in admin_json(coord, "events")["events"]] == ["coordinator_started"]
    # other bad input, all one line
    assert "no run yet" in one_error_line(admin(coord, "tokens", "create"))
    assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
    assert "already exists" in one_error_line(
        admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest))
    )
    assert "is not a duration" in one_error_line(admin(coord, "tokens", "create", "--ttl", "soon"))
    assert "no node" in one_error_line(admin(coord, "nodes", "ban", "nxxxx"))
    assert "no run 'nope'" in one_error_line(admin(coord, "shards", "list", "--run", "nope"))


def test_serve_refuses_bad_arguments(tmp_path):
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "murmur.cli",
            "coordinator",
            "serve",
            "--db",
            str(tmp_path / "c.db"),
            "--listen",
            "nowhere",
            "--no-dht",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "must look like HOST:PORT" in one_error_line(bad)
    ttl = subprocess.run(
        [
            sys.executable,
            "-m",
            "murmur.cli",
            "coordinator",
            "serve",
            "--db",
            str(tmp_path / "c.db"),
            "--listen",
            "127.0.0.1:0",
            "--heartbeat-ttl",
            "0.1",
            "--no-dht",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "heartbeat_ttl_s" in one_error_line(ttl)


def test_serve_migrates_an_older_ledger_and_refuses_an_unknown_one(tmp_path):
    from murmur.coordinator.store import SCHEMA_VERSION, Store

    old = Store(tmp_path / "old.db", migrate_to=1)
    old.close()
    c = start_coordinator(tmp_path / "old.db")
    try:
        assert (c.info["migrated_from"], c.info["schema_version"]) == (1, SCHEMA_VERSION)
    finally:
        c.stop()
    future = Store(tmp_path / "future.db")
    future.db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 7,))
    future.close()
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "murmur.cli",
            "coordinator",
            "serve",
            "--db",
            str(tmp_path / "future.db"),
            "--listen",
            "127.0.0.1:0",
            "--no-dht",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "newer than this murmur knows" in one_error_line(refused)


def test_a_run_that_completes_no_round_shows_as_stalled(tmp_path):
    """An active member and no round past --stall-after: `admin status`, /api/status and /metrics
    all say stalled (test_coordinator_stall.py has the rules, on a hand-driven clock)."""
    with stalled_run(tmp_path) as coord:
        status = admin_json(coord, "status")
        assert status["stalled"] and status["last_round_at"] == 0 and status["stall_after_s"] == 1
        assert "with 1 active node" in status["stall_reason"], status
        table = admin(coord, "status").stdout
        assert "STALLED (no round for over 1s): no round completed" in table and "last round none yet" in table
        base = f"http://{coord.info['metrics']}"
        api = json.loads(urllib.request.urlopen(f"{base}/api/status", timeout=10).read())
        assert api["status"]["stalled"] is True and api["status"]["stall_reason"]
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert 'murmur_run_stalled{run="test-run"} 1.0' in metrics and 'murmur_run_round{run="test-run"} 0.0' in metrics


def test_a_leaving_node_hears_what_it_gave_and_a_bad_name_is_refused(steady_coord, tmp_path):
    from murmur.protocol.coordinator_client import CoordinatorError

    coord = steady_coord
    config, manifest = write_run_files(tmp_path, [400, 200])
    assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
    token = new_token(coord, "--uses", "3")

    async def work() -> None:
        with pytest.raises(CoordinatorError, match="at most 40 characters"):
            await join(coord, token, name="x" * 41)
        client, _ = await join(coord, token)
        async with client:
            await client.heartbeat(tokens_per_s=1.0)
            lease = (await client.acquire()).lease
            await client.commit(lease.lease_id, lease.shard_id, 0, 250, outer_step=3, loss=2.5, bytes_sent=1, seconds=1)
            await client.commit(lease.lease_id, lease.shard_id, 250, 400, outer_step=4, loss=2.4, bytes_sent=1,
                                seconds=1)
            other, _ = await join(coord, token, name="bob")
            async with other:
                await other.heartbeat(tokens_per_s=1.0)
                second = (await other.acquire()).lease
                await other.commit(second.lease_id, second.shard_id, 0, 200, outer_step=4, loss=2.4,
                                   bytes_sent=1, seconds=1)
            reply = await client.leave("done")
        assert (reply.tokens_committed, reply.rounds, reply.run_tokens_committed) == (400, 2, 600)

    asyncio.run(work())
    uses = [t["uses_left"] for t in admin_json(coord, "tokens", "list")["tokens"]]
    assert uses == [1]  # the refused name used nothing up
