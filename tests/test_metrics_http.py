"""The coordinator's HTTP port against a real coordinator process: /api/status agrees with the
ledger and with `murmur admin status`, /metrics through prometheus_client, admin actions need the
credential, and bad clients get clear HTTP errors while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import urllib.error
import urllib.request

import pytest
from _coordinator_helpers import admin, admin_json, join, new_token, start_coordinator, write_run_files
from prometheus_client.parser import text_string_to_metric_families

from murmur.node.daemon.metrics import NodeCollector, NodeMetrics

pytestmark = pytest.mark.integration


@pytest.fixture
def coord(tmp_path):
    c = start_coordinator(tmp_path / "coord.db", "--heartbeat-ttl", "120", "--lease-ttl", "120")
    try:
        yield c
    finally:
        c.stop()


def http(coord, path, method="GET", body=None, headers=None):
    """(status, body text) of one request; HTTP errors are answers too."""
    req = urllib.request.Request(f"http://{coord.info['metrics']}{path}", data=body, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def raw(coord, data: bytes, timeout_s: float = 30.0) -> bytes:
    """Send raw bytes, read until the server closes (or answers and closes)."""
    host, port = coord.info["metrics"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may answer and close before it has read everything we send
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _joined_with_work(coord, tmp_path):
    config, manifest = write_run_files(tmp_path, [1000, 400])
    assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
    token = new_token(coord, "--uses", "2")

    async def work() -> str:
        client, node_id = await join(coord, token)
        async with client:
            await client.heartbeat(tokens_per_s=1234.0)
            lease = (await client.acquire()).lease
            await client.commit(lease.lease_id, lease.shard_id, 0, 250, outer_step=3, loss=2.5, bytes_sent=4096,
                                seconds=0.5)
            await client.commit(lease.lease_id, lease.shard_id, 250, 500, outer_step=4, loss=2.25, bytes_sent=1000,
                                seconds=0.5, val_loss=2.4)
            await client.release(lease.lease_id)
            with pytest.raises(Exception, match="no longer yours"):  # a commit under a released lease
                await client.commit(lease.lease_id, lease.shard_id, 500, 600, outer_step=5, loss=2.0,
                                    bytes_sent=10, seconds=0.1)
        return node_id

    return asyncio.run(work())


def test_api_status_agrees_with_the_ledger_and_the_admin_cli(coord, tmp_path):
    node_id = _joined_with_work(coord, tmp_path)
    code, text = http(coord, "/api/status")
    assert code == 200, text
    page = json.loads(text)
    cli = admin_json(coord, "status")
    # The same builder serves both: every field but the moving rate and the last round's age agrees.
    for d in (page["status"], cli):
        d.pop("tokens_per_s")
        assert 0 <= d.pop("last_round_age_s") < 120 and not d["stalled"]
        for n in d["nodes"]:
            n.pop("last_heartbeat")
    assert page["status"] == cli
    # One node committed: DDP with one worker sends nothing, so there is no ratio to show.
    assert page["run"] == {"algorithm": "diloco", "codec": "fp32", "inner_steps": 10, "run_id": "test-run",
                           "state": "active", "ddp_bytes": 0, "reduction_vs_ddp": 0.0}
    [row] = page["nodes"]
    assert row["node_id"] == node_id and row["status"] == "active"
    assert (row["round"], row["tokens_committed"], row["bytes_sent"]) == (4, 500, 5096)
    assert (row["restarts"], row["commits_refused"], row["updates_rejected"]) == (0, 1, 0)
    assert not row["heartbeat_late"]
    assert row["state_hash"] == ""  # it never announced a state (a live trainer's last heartbeat names its hash)
    assert [(r["round"], r["loss"], r["val_loss"]) for r in page["rounds"]] == [(3, 2.5, None), (4, 2.25, 2.4)]
    assert [(s["shard_id"], s["committed"], s["holder"]) for s in page["shards"]] == [(0, 500, ""), (1, 0, "")]
    kinds = [e["kind"] for e in page["events"]]
    assert {"run_created", "join", "lease_granted", "lease_released", "commit_refused"} <= set(kinds)

    code, html = http(coord, "/")
    assert code == 200 and "<svg" not in html  # the chart is drawn by the page's own script
    assert "<script src" not in html and "<link" not in html and "http://" not in html.replace("http://www.w3.org", "")
    assert '"node_id": "' + node_id in html  # the status at serving time is embedded for the first paint

    code, text = http(coord, "/metrics")
    assert code == 200
    got = samples(text)
    assert got[("murmur_tokens_committed_total", ())] == 500
    assert got[("murmur_rounds_total", ())] == 2
    run = (("run", "test-run"),)
    assert got[("murmur_run_round", run)] == 4 and got[("murmur_run_val_loss", run)] == 2.4
    assert got[("murmur_run_stalled", run)] == 0 and 0 <= got[("murmur_run_seconds_since_round", run)] < 120
    assert got[("murmur_commits_refused_total", ())] == 1
    assert got[("murmur_lease_churn_total", (("kind", "granted"),))] == 1
    assert got[("murmur_lease_churn_total", (("kind", "released"),))] == 1
    assert got[("murmur_bytes_sent_total", (("codec", "fp32"), ("run", "test-run")))] == 5096
    labels = (("node", node_id), ("run", "test-run"))
    assert got[("murmur_node_bytes_sent_total", labels)] == 5096
    assert got[("murmur_node_commits_refused_total", labels)] == 1
    assert got[("murmur_node_tokens_per_s", labels)] == 1234.0


def test_actions_need_the_admin_credential(coord, tmp_path):
    node_id = _joined_with_work(coord, tmp_path)
    path = f"/api/nodes/{node_id}/ban"
    code, text = http(coord, path, "POST", b"{}")
    assert code == 401 and "admin credential" in json.loads(text)["error"]
    code, text = http(coord, path, "POST", b"{}", {"Authorization": "Bearer wrong"})
    assert code == 403 and "wrong" in json.loads(text)["error"]
    assert admin_json(coord, "nodes", "show", node_id)["status"] == "active"
    key = open(coord.info["admin_key_file"]).read().strip()
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    code, text = http(coord, "/api/nodes/nobody/ban", "POST", b"{}", auth)  # after the credential
    assert code == 404
    code, text = http(coord, path, "POST", b"not json", auth)
    assert code == 400 and "JSON" in json.loads(text)["error"]
    code, text = http(coord, path, "POST", json.dumps({"reason": "poisoned updates"}).encode(), auth)
    assert code == 200 and json.loads(text)["status"] == "banned"
    shown = admin_json(coord, "nodes", "show", node_id)
    assert shown["status"] == "banned" and shown["ban_reason"] == "poisoned updates"
    code, _ = http(coord, f"/api/nodes/{node_id}/unban", "POST", None, auth)
    assert code == 200 and admin_json(coord, "nodes", "show", node_id)["status"] == "left"


def test_bad_clients_get_clear_errors_and_the_server_keeps_serving(coord):
    def status_line(reply: bytes) -> str:
        return reply.split(b"\r\n", 1)[0].decode()

    # A 1 MB path: 414, not silence.
    huge_path = raw(coord, b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_line(huge_path) == "HTTP/1.1 414 URI Too Long"
    # One huge header, and many headers: 431.
    big = raw(coord, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert status_line(big) == "HTTP/1.1 431 Request Header Fields Too Large"
    many = raw(coord, b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(5000)) + b"\r\n")
    assert status_line(many) == "HTTP/1.1 431 Request Header Fields Too Large"

    # A slow client holds its connection while others are served; it is answered 408 in the end.
    slow_reply: list[bytes] = []
    slow = threading.Thread(target=lambda: slow_reply.append(raw(coord, b"GET /api/sta", timeout_s=60)))
    slow.start()
    assert http(coord, "/api/status")[0] == 200
    slow.join(60)
    assert slow_reply and status_line(slow_reply[0]) == "HTTP/1.1 408 Request Timeout", slow_reply

    code, text = http(coord, "/no/such/page")
    assert code == 404 and text.strip() == "404 Not Found: GET /no/such/page (routes: GET /, /api/status, /metrics)"
    code, text = http(coord, "/api/status", "POST", b"{}")
    assert code == 405
    key = open(coord.info["admin_key_file"]).read().strip()
    code, _ = http(coord, "/api/nodes/x/ban", "POST", b"x" * 100_000, {"Authorization": "Bearer k"})
    assert code == 403  # the credential is checked before the body is read
    code, _ = http(coord, "/api/nodes/x/ban", "POST", b"x" * 100_000, {"Authorization": f"Bearer {key}"})
    assert code == 413
    code, text = http(coord, "/api/status?run=nope")
    assert code == 404 and "nope" in json.loads(text)["error"]
    garbage = raw(coord, b"\x00\x01\x02 nonsense\r\n\r\n")
    assert status_line(garbage).startswith("HTTP/1.") and " 400 " in status_line(garbage)

    assert http(coord, "/api/status")[0] == 200 and http(coord, "/metrics")[0] == 200
    coord.proc.send_signal(signal.SIGTERM)
    log = coord.proc.stderr.read()
    coord.proc.wait(30)
    assert "Traceback" not in log and "414" in log and "408" in log, log  # one line per refusal


def test_node_metrics_escape_label_values():
    m = NodeMetrics(
        round=7, bytes_sent_total=123, compute_seconds_total=3.0, exchange_wait_seconds_total=1.5,
        wall_seconds_total=5.0,
    )
    families = list(NodeCollector(m, {"node": 'a"b\\c\nd', "run": "r"}).collect())
    from prometheus_client import CollectorRegistry, generate_latest

    class Fixed:
        def collect(self):
            return families

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Fixed())
    text = generate_latest(reg).decode()
    assert 'node="a\\"b\\\\c\\nd"' in text  # quote, backslash and newline escaped by the library
    got = samples(text)
    labels = (("node", 'a"b\\c\nd'), ("run", "r"))
    assert got[("murmur_node_round", labels)] == 7
    for phase, seconds in (("compute", 3.0), ("exchange", 1.5), ("wait", 0.5)):
        key = tuple(sorted((*labels, ("phase", phase))))
        assert got[("murmur_node_round_seconds_total", key)] == seconds
