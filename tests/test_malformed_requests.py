"""Bytes that are not a protobuf message, sent to every method of every gRPC service (coordinator,
peer, pipeline stage): each is refused with INVALID_ARGUMENT and a one-line reason naming the message
type, and the server goes on serving (protocol/malformed.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import grpc
import pytest
from _coordinator_helpers import FAST, admin, start_coordinator
from _net_helpers import RUN, no_lost_task_exceptions, peer_group  # noqa: F401 - a fixture

from murmur.protocol import coordinator_pb2, peer_pb2, pipeline_pb2, tls
from murmur.protocol.version import version_metadata

REPO = Path(__file__).resolve().parents[1]

# A length-delimited field 1 whose length runs past the end: no message type parses it.
GARBAGE = b"\x0a\xff\xff\x01garbage"


def _methods(pb2, service: str) -> list[tuple[str, str, bool, bool]]:
    """(path, input type, client streams, server streams) of every method of ``service``."""
    desc = pb2.DESCRIPTOR.services_by_name[service]
    return [
        (f"/{desc.full_name}/{m.name}", m.input_type.name, m.client_streaming, m.server_streaming)
        for m in desc.methods
    ]


async def _send_garbage(channel: grpc.aio.Channel, path: str, client_streams: bool, server_streams: bool):
    """One call carrying GARBAGE as its (first) request; (code, details)."""
    md = version_metadata()
    try:
        if client_streams:
            call = channel.stream_stream(path)(metadata=md, timeout=20)
            await call.write(GARBAGE)
            await call.done_writing()
            async for _ in call:
                pass
        elif server_streams:
            async for _ in channel.unary_stream(path)(GARBAGE, metadata=md, timeout=20):
                pass
        else:
            await channel.unary_unary(path)(GARBAGE, metadata=md, timeout=20)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _assert_refused(results: dict[str, tuple[grpc.StatusCode, str]], types: dict[str, str]) -> None:
    for path, (code, details) in results.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
        assert details.startswith(f"malformed {types[path]}: "), (path, details)
        assert "\n" not in details and len(details) < 300, (path, details)


def test_a_peer_refuses_a_malformed_request_on_every_method_and_keeps_serving():
    with peer_group(2) as (loop, peers, _):
        caller, server = peers
        methods = _methods(peer_pb2, "Peer")
        assert {p.rsplit("/", 1)[1] for p, *_ in methods} == {"Hello", "Exchange", "GetState"}

        async def scenario():
            async with tls.secure_channel(caller.identity, server.server.address, server.node_id) as ch:
                got = {p: await _send_garbage(ch, p, cs, ss) for p, _, cs, ss in methods}
                hello = ch.unary_unary(
                    "/murmur.v1.Peer/Hello",
                    request_serializer=peer_pb2.HelloRequest.SerializeToString,
                    response_deserializer=peer_pb2.HelloReply.FromString,
                )
                reply = await hello(peer_pb2.HelloRequest(run_id=RUN), metadata=version_metadata(), timeout=20)
                return got, reply

        got, reply = loop.run(scenario())
        _assert_refused(got, {p: t for p, t, *_ in methods})
        assert reply.node_id == server.node_id  # still serving


def test_a_pipeline_stage_refuses_a_malformed_request_on_every_method_and_keeps_serving():
    from murmur.node.model.stages import build_stage, split_layers
    from murmur.node.model.transformer import model_config
    from murmur.node.net.loop import LoopThread
    from murmur.node.pipeline.service import StageService
    from murmur.node.pipeline.worker import StageWorker
    from murmur.protocol.identity import CertificateAuthority
    from murmur.protocol.runconfig import OptimSection

    cfg = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=16), tie_embeddings=False)
    ca = CertificateAuthority.create("stage-test")
    loop = LoopThread()
    worker = StageWorker(build_stage(cfg, 5, split_layers(2, 1)[0]), OptimSection(lr=1e-3), target_samples=10)
    svc = StageService(ca.issue(), worker, run_id="stage-test")
    try:
        loop.run(svc.start())
        methods = _methods(pipeline_pb2, "Stage")
        caller = ca.issue()

        async def scenario():
            async with tls.secure_channel(caller, svc.address, svc.identity.node_id) as ch:
                got = {p: await _send_garbage(ch, p, cs, ss) for p, _, cs, ss in methods}
                info = ch.unary_unary(
                    "/murmur.v1.Stage/Info",
                    request_serializer=pipeline_pb2.StageInfoRequest.SerializeToString,
                    response_deserializer=pipeline_pb2.StageInfo.FromString,
                )
                return got, await info(pipeline_pb2.StageInfoRequest(), metadata=version_metadata(), timeout=20)

        got, reply = loop.run(scenario())
        _assert_refused(got, {p: t for p, t, *_ in methods})
        assert reply.ByteSize() > 0  # still serving
    finally:
        loop.run(svc.stop())
        loop.stop()


@pytest.mark.integration
def test_the_coordinator_refuses_a_malformed_request_on_every_method_and_keeps_serving(tmp_path):
    coord = start_coordinator(tmp_path / "coord.db", *FAST)
    try:
        methods = _methods(coordinator_pb2, "Coordinator")
        ca_pem = open(coord.info["ca_cert_file"], "rb").read()

        async def scenario():
            creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
            options = [("grpc.ssl_target_name_override", "murmur-coordinator")]
            async with grpc.aio.secure_channel(coord.address, creds, options=options) as ch:
                return {p: await _send_garbage(ch, p, cs, ss) for p, _, cs, ss in methods}

        got = asyncio.run(scenario())
        assert len(got) == len(methods) > 20
        _assert_refused(got, {p: t for p, t, *_ in methods})
        listed = admin(coord, "runs", "list")  # still serving
        assert listed.returncode == 0, listed.stderr
    finally:
        assert coord.stop() == 0


def test_no_servicer_is_registered_around_the_guard():
    """Every server registers its servicer through protocol/malformed.py: nowhere in the package is
    a generated ``add_*Servicer_to_server`` called directly (a new server would answer UNKNOWN)."""
    direct = []
    folders = ("murmur", "node", "protocol", "optim", "kernels", "coordinator", "benchmarks")
    for path in (p for folder in folders for p in (REPO / folder).rglob("*.py")):
        rel = path.relative_to(REPO)
        if path.name.endswith("_pb2_grpc.py"):
            continue
        for m in re.finditer(r"add_\w+Servicer_to_server\(", path.read_text()):
            direct.append(f"{rel}: {m.group(0)}")
    assert not direct, direct
