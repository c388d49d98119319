"""Heartbeats on one long-lived stream per node (HeartbeatStream), and the unary fallback.

A real coordinator process answers a member client's heartbeats on one stream (its metrics count
them as HeartbeatStream calls, none as Heartbeat); a refusal ends the stream with the unary call's
status and reason, and the next heartbeat opens a fresh stream. A coordinator of a build from
before the stream (the real coordinator in process, its servicer registered without that method,
so gRPC itself answers UNIMPLEMENTED as an older build does) gets unary heartbeats instead.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from _coordinator_helpers import CONFIG, FAST, admin, join, new_token, start_coordinator, write_run_files

from murmur.coordinator.server import Coordinator, ServeOptions
from murmur.coordinator.serving import serving_options
from murmur.coordinator.settings import CoordinatorSettings
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import coordinator_pb2_grpc as pb_grpc
from murmur.protocol import identity
from murmur.protocol.admin_client import AdminClient, resolve
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient, join_run

pytestmark = pytest.mark.integration


def calls(coord, method: str) -> int:
    with urllib.request.urlopen(f"http://{coord.info['metrics']}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = re.search(rf'murmur_rpc_calls_total{{method="{method}"}} ([0-9.e+]+)', text)
    return int(float(found.group(1))) if found else 0


def test_heartbeats_go_on_one_stream_and_a_refusal_ends_it_with_the_unary_calls_status(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *FAST, "--heartbeat-udp", "off")  # the gRPC path itself
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(coord, "--uses", "2")

        async def scenario() -> None:
            client, node_id = await join(coord, token)
            async with client:
                first = await client.heartbeat(1.0)
                stream = client._beats
                for _ in range(2):
                    assert (await client.heartbeat(1.0)).run_state == "active"
                assert client._beats is stream and client.heartbeat_stream  # one stream, kept open
                assert calls(coord, "HeartbeatStream") == 3 and calls(coord, "Heartbeat") == 0
                assert first.ban_list_changed and not (await client.heartbeat(1.0)).ban_list_changed
                banned = admin(coord, "nodes", "ban", node_id, "--reason", "test")
                assert banned.returncode == 0, banned.stderr
                with pytest.raises(CoordinatorError, match="banned") as err:
                    await client.heartbeat(1.0)
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert client._beats is None  # the refusal ended it: the next heartbeat opens another
                with pytest.raises(CoordinatorError, match="banned"):
                    await client.heartbeat(1.0)
            # Another node's stream was never disturbed by that: it sees the ban list change.
            other, _ = await join(coord, token)
            async with other:
                reply = await other.heartbeat(1.0)
                assert node_id in reply.ban_list.node_ids

        asyncio.run(scenario())
    finally:
        coord.stop()


class _WithoutStream:
    """What an older build's servicer registration looked like: every method but HeartbeatStream."""

    def __init__(self, server: object) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Skip(h) for h in handlers))  # type: ignore[attr-defined]

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        kept = {m: h for m, h in handlers.items() if m != "HeartbeatStream"}
        self._server.add_registered_method_handlers(service, kept)  # type: ignore[attr-defined]


class _Skip(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.endswith("/HeartbeatStream"):
            return None
        return self._inner.service(details)


def test_a_coordinator_without_the_stream_gets_unary_heartbeats(tmp_path, monkeypatch):
    real_add = pb_grpc.add_CoordinatorServicer_to_server
    older = lambda servicer, server: real_add(servicer, _WithoutStream(server))  # noqa: E731
    monkeypatch.setattr(pb_grpc, "add_CoordinatorServicer_to_server", older)

    async def scenario() -> None:
        coordinator = Coordinator(ServeOptions(db=tmp_path / "old.db", listen="127.0.0.1:0",
                                               node_listen="127.0.0.1:0", metrics_listen="off",
                                               settings=CoordinatorSettings(heartbeat_udp="off")))  # older: no UDP
        info = await coordinator.start()
        try:
            def create_run() -> str:  # the real admin calls, from a thread: this loop serves them
                with AdminClient(resolve(str(info["address"]), str(info["admin_key_file"]), None)) as a:
                    manifest = '{"shards": [{"id": 0, "file": "s0", "tokens": 100}]}'
                    a.call("CreateRun", pb.CreateRunRequest(config_toml=CONFIG, manifest_json=manifest))
                    return a.call("CreateToken", pb.CreateTokenRequest(ttl_s=3600, uses=1)).token

            token = await asyncio.to_thread(create_run)
            ident, joined = await join_run(str(info["address"]), token, identity.generate_key())
            async with MemberClient(joined.node_address, ident, server_name=joined.tls_server_name) as client:
                assert (await client.heartbeat(1.0)).run_state == "active"  # UNIMPLEMENTED, then unary
                assert not client.heartbeat_stream
                assert (await client.heartbeat(1.0)).run_state == "active"
            member_calls = {m: n for m, n in coordinator.service.stats.calls.items() if "Heartbeat" in m}
            assert member_calls == {"Heartbeat": 2}
        finally:
            await coordinator.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("call_wait_s", "cancelled"), [(1.0, True), (30.0, False)])
def test_streams_opened_while_the_loop_is_saturated_wait_for_it_instead_of_being_cancelled(
    tmp_path, call_wait_s, cancelled
):
    """A saturated coordinator takes new calls slowly; gRPC's core cancels a call nobody took
    within its bound (30 s by default: at 10,000 nodes the streams opening together were CANCELLED
    in thousands). The real coordinator's loop is stalled while 40 nodes in another process open
    their heartbeat streams in 8 waves 0.5 s apart, and 1.5 s more: with a bound of 1 s, calls are
    CANCELLED (what the fleet saw); with the coordinator's bound (call_wait_s, here 30 s, an hour
    by default) every stream is answered once the loop is back."""
    settings = CoordinatorSettings(call_wait_s=call_wait_s)
    assert ("grpc.server_max_unrequested_time_in_server", round(call_wait_s)) in serving_options(settings)
    assert CoordinatorSettings().call_wait_s >= 3600

    async def scenario() -> dict[str, int]:
        coordinator = Coordinator(ServeOptions(db=tmp_path / "c.db", listen="127.0.0.1:0", node_listen="127.0.0.1:0",
                                               metrics_listen="off", settings=settings))
        info = await coordinator.start()
        nodes = None
        try:
            def create_run() -> str:  # the real admin calls, from a thread: this loop serves them
                with AdminClient(resolve(str(info["address"]), str(info["admin_key_file"]), None)) as a:
                    manifest = '{"shards": [{"id": 0, "file": "s0", "tokens": 100}]}'
                    a.call("CreateRun", pb.CreateRunRequest(config_toml=CONFIG, manifest_json=manifest))
                    return a.call("CreateToken", pb.CreateTokenRequest(ttl_s=3600, uses=40)).token

            token = await asyncio.to_thread(create_run)
            nodes = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "_stream_waves.py"), str(info["address"]), token,
                 "40", "8", "0.5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            assert (await asyncio.to_thread(nodes.stdout.readline)).strip() == "joined"
            nodes.stdin.write("go\n")
            nodes.stdin.flush()
            # The loop saturated: nothing takes the streams' calls until every wave is sent and
            # the last has waited past the 1 s bound too (blocking reads, on the loop itself).
            assert nodes.stdout.readline().strip() == "sent"
            time.sleep(1.5)
            line = await asyncio.to_thread(nodes.stdout.readline)
            assert await asyncio.to_thread(nodes.wait, 60) == 0
            return json.loads(line)
        finally:
            if nodes is not None and nodes.poll() is None:
                nodes.kill()
                nodes.wait()
            await coordinator.close()

    outcomes = asyncio.run(scenario())
    if cancelled:
        assert outcomes.get("CANCELLED", 0) > 0, outcomes
    else:
        assert outcomes == {"ok": 40}, outcomes
