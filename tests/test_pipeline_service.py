"""The stage service over real gRPC with mutual TLS: round trips, codecs, and bad input refused
with a reason while the stage keeps serving."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.pipeline import codec
from murmur.node.pipeline.client import StageClient, StageEndpoint
from murmur.node.pipeline.service import StageService, StageServiceSettings
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol import pipeline_pb2, pipeline_pb2_grpc, tls
from murmur.protocol.identity import BanList, CertificateAuthority
from murmur.protocol.runconfig import OptimSection
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata

RUN = "stage-test"
CFG = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=16), tie_embeddings=False)
OPTIM = OptimSection(lr=1e-3, warmup_steps=0, grad_clip=0.0)
ROWS, T = 2, 16


@pytest.fixture
def pipeline():
    """Two stages, one peer each, and a client; plus local twins of the workers for reference."""
    ca = CertificateAuthority.create("stage-test")
    loop = LoopThread()
    spans = split_layers(CFG.n_layers, 2)
    ban = BanList()
    services = []
    try:
        for span in spans:
            worker = StageWorker(build_stage(CFG, 5, span), OPTIM, target_samples=1000)
            svc = StageService(ca.issue(), worker, run_id=RUN, ban_list=ban,
                               settings=StageServiceSettings(max_rows=4, max_message_bytes=1 << 20))
            loop.run(svc.start())
            services.append(svc)
        client_id = ca.issue()
        client = StageClient(client_id, run_id=RUN)
        peers = [StageEndpoint(s.identity.node_id, s.address, s.span.index) for s in services]
        yield loop, ca, services, client, peers, ban, client_id
    finally:
        loop.run(client.aclose())
        for s in services:
            loop.run(s.stop())
        loop.stop()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, CFG.vocab_size, (ROWS, T), generator=g) for _ in range(2))


@pytest.mark.parametrize("wire", ["fp32", "bf16", "int8"])
def test_round_trip_matches_the_local_computation(pipeline, wire):
    loop, _, services, client, peers, _, _ = pipeline
    x, y = batch()
    local = [StageWorker(build_stage(CFG, 5, s.span), OPTIM, target_samples=1000) for s in services]
    h_local = local[0].forward(x)
    back_local = local[1].backward(h_local, targets=y)
    h, _ = loop.run(client.forward(peers[0], "mb0", x, reply_codec=wire, timeout=30, dim=CFG.dim))
    last = loop.run(client.backward(peers[1], "mb0", h, targets=y, reply_codec=wire, timeout=30, dim=CFG.dim))
    first = loop.run(client.backward(peers[0], "mb0", x, grad_outputs=last.grad_inputs, reply_codec=wire,
                                     timeout=30, dim=CFG.dim))
    assert first.grad_inputs is None
    tol = {"fp32": 1e-6, "bf16": 2e-2, "int8": 3e-2}[wire]
    assert torch.allclose(h, h_local, atol=tol * h_local.abs().max().item())
    assert abs(last.loss - back_local.loss) < tol * 10
    rel = (last.grad_inputs - back_local.grad_inputs).norm() / back_local.grad_inputs.norm()
    assert rel < tol * 5, rel
    assert [s.worker.stats.samples_accumulated for s in services] == [ROWS, ROWS]


def raw(loop, peer: StageEndpoint, method: str, request, channel_credentials=None, client_id=None):
    """One hand-made call; returns the status code and details."""
    async def go():
        if channel_credentials is None:
            ch = tls.secure_channel(client_id, peer.address, peer.node_id)
        else:
            ch = grpc.aio.secure_channel(peer.address, channel_credentials, options=tls.channel_options(peer.node_id))
        async with ch:
            stub = pipeline_pb2_grpc.StageStub(ch)
            try:
                await getattr(stub, method)(request, metadata=version_metadata(), timeout=20)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""
    return loop.run(go())


def fwd(stage=1, inputs=None, **kw):
    if inputs is None:
        inputs = codec.encode(torch.randn(ROWS, T, CFG.dim), "fp32")
    return pipeline_pb2.ForwardRequest(protocol_version=PROTOCOL_VERSION, run_id=RUN, stage=stage,
                                       microbatch="bad", inputs=inputs, reply_codec="bf16", **kw)


def test_bad_input_is_refused_with_a_reason_and_the_stage_keeps_serving(pipeline):
    loop, ca, services, client, peers, ban, client_id = pipeline
    nan = torch.randn(ROWS, T, CFG.dim)
    nan[0, 3, 5] = float("nan")
    back_nan = pipeline_pb2.BackwardRequest(
        protocol_version=PROTOCOL_VERSION, run_id=RUN, stage=0, microbatch="bad",
        inputs=codec.encode(batch()[0], "tokens"), grad_outputs=codec.encode(nan, "fp32"), reply_codec="fp32",
    )
    tokens = codec.encode(batch()[0], "tokens")
    stage0 = peers[0]
    cases = {
        "wrong shape": (stage0, "Forward", fwd(0, codec.encode(torch.randint(0, 9, (ROWS, T, 2)), "tokens")),
                        grpc.StatusCode.INVALID_ARGUMENT, "dimensions"),
        "wrong hidden size": (peers[1], "Backward", pipeline_pb2.BackwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=RUN, stage=1, microbatch="bad",
            inputs=codec.encode(torch.randn(ROWS, T, CFG.dim + 1), "fp32"),
            targets=tokens), grpc.StatusCode.INVALID_ARGUMENT, "expected"),
        "nan": (stage0, "Backward", back_nan, grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
        "token out of vocabulary": (stage0, "Forward", fwd(0, codec.encode(torch.full((ROWS, T), 999), "tokens")),
                                    grpc.StatusCode.INVALID_ARGUMENT, "outside"),
        "oversized rows": (stage0, "Forward", fwd(0, codec.encode(torch.zeros(5, T, dtype=torch.long), "tokens")),
                           grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized"),
        "oversized message": (peers[1], "Backward", pipeline_pb2.BackwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=RUN, stage=1, microbatch="bad",
            inputs=codec.encode(torch.randn(4, 2048, 256), "fp32")), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        "wrong stage": (stage0, "Forward", fwd(1), grpc.StatusCode.FAILED_PRECONDITION, "wrong stage"),
        "wrong run": (stage0, "Forward", pipeline_pb2.ForwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id="other", stage=0, inputs=tokens),
            grpc.StatusCode.FAILED_PRECONDITION, "run mismatch"),
        "forward to the last stage": (peers[1], "Forward", fwd(1), grpc.StatusCode.FAILED_PRECONDITION,
                                      "evaluates targets"),
        "targets to a stage before the last": (stage0, "Forward", fwd(0, tokens, targets=tokens),
                                               grpc.StatusCode.FAILED_PRECONDITION, "evaluates targets"),
        "evaluated targets out of vocabulary": (peers[1], "Forward", fwd(
            1, targets=codec.encode(torch.full((ROWS, T), 999), "tokens")), grpc.StatusCode.INVALID_ARGUMENT,
            "outside"),
    }
    for name, (peer, method, request, code, words) in cases.items():
        got, details = raw(loop, peer, method, request, client_id=client_id)
        assert got == code, (name, got, details)
        assert words in details, (name, details)
    # No certificate, or one of another run's CA: the handshake fails, nothing reaches a handler.
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem)
    stranger = CertificateAuthority.create("other").issue()
    foreign = grpc.ssl_channel_credentials(ca.cert_pem, stranger.key_pem, stranger.cert_pem)
    for creds in (no_cert, foreign):
        got, _ = raw(loop, peers[0], "Forward", fwd(0, tokens), channel_credentials=creds)
        assert got == grpc.StatusCode.UNAVAILABLE
    # A banned node is refused by name.
    banned = ca.issue()
    ban.ban(banned.node_id, "poisoned gradients")
    got, details = raw(loop, peers[0], "Forward", fwd(0, tokens), client_id=banned)
    assert got == grpc.StatusCode.PERMISSION_DENIED and "poisoned" in details
    # Nothing was accumulated and both stages still serve a good microbatch.
    assert [s.worker.stats.samples_accumulated for s in services] == [0, 0]
    x, y = batch()
    h, _ = loop.run(client.forward(peers[0], "ok", x, reply_codec="bf16", timeout=30, dim=CFG.dim))
    last = loop.run(client.backward(peers[1], "ok", h, targets=y, reply_codec="bf16", timeout=30, dim=CFG.dim))
    assert last.grad_inputs is not None and torch.isfinite(last.grad_inputs).all()
    assert len(services[0].refusals) >= 6 and services[1].refusals
    assert loop.run(client.info(peers[0])).refused == len(services[0].refusals)


def test_an_evaluation_on_the_last_stage_gives_the_training_loss_and_changes_nothing(pipeline):
    loop, _, services, client, peers, _, _ = pipeline
    x, y = batch()
    h = services[0].worker.forward(x)
    before = [p.detach().clone() for p in services[1].worker.params]
    loss, nbytes = loop.run(client.evaluate(peers[1], "eval", h, y, activation_codec="fp32", timeout=30))
    assert nbytes > 0 and services[1].worker.stats.samples_accumulated == 0
    assert all(torch.equal(a, b) for a, b in zip(before, services[1].worker.params, strict=True))
    last = loop.run(client.backward(peers[1], "train", h, targets=y, reply_codec="fp32", timeout=30, dim=CFG.dim))
    assert loss == pytest.approx(last.loss, rel=1e-5)  # the same loss the backward trains on


def test_a_call_still_queued_when_its_caller_gives_up_is_never_computed(pipeline):
    """One compute thread a peer: a call waits behind the one computing. When its caller's
    deadline passes while it waits, it leaves the queue without being computed, and the queue
    count (what the peer reports) goes back to 0."""
    loop, _, services, client, peers, _, _ = pipeline
    svc = services[1]
    svc.faults = FaultInjector()
    svc.faults.arm("delay", point="stage_compute", seconds=2.0)  # the first call only
    x, y = batch()
    h = services[0].worker.forward(x)

    async def one_computing_one_abandoned():
        slow = asyncio.create_task(
            client.backward(peers[1], "slow", h, targets=y, reply_codec="fp32", timeout=60, dim=CFG.dim))
        while svc.queue == 0:  # the slow call holds the compute thread (in its injected delay)
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.backward(peers[1], "late", h, targets=y, reply_codec="fp32", timeout=0.3, dim=CFG.dim)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return await slow

    answer = loop.run(one_computing_one_abandoned())
    assert answer.loss > 0
    assert svc.worker.stats.backwards == 1 and svc.worker.stats.samples_accumulated == ROWS
    assert svc.queue == 0


def test_a_backward_the_caller_gave_up_on_is_not_accumulated(pipeline):
    loop, _, services, client, peers, _, _ = pipeline
    services[1].faults = FaultInjector()
    services[1].faults.arm("delay", point="stage_compute", seconds=1.0)
    x, y = batch()
    h = services[0].worker.forward(x)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        loop.run(client.backward(peers[1], "late", h, targets=y, reply_codec="fp32", timeout=0.3, dim=CFG.dim))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def computed():  # the peer finishes the computation after the caller left
        while services[1].queue or services[1].worker.stats.backwards == 0:
            await asyncio.sleep(0.05)
    loop.run(computed())
    assert services[1].worker.stats.backwards == 1
    assert services[1].worker.stats.samples_accumulated == 0
