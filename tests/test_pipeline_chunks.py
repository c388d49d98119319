"""Payloads above the message cap cross a stage boundary as chunk streams (real gRPC, real sockets,
mutual TLS), intact; malformed, oversized or inconsistent streams are refused with one line and
the stage keeps serving."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.net.loop import LoopThread
from murmur.node.pipeline import chunks, codec
from murmur.node.pipeline.client import StageClient, StageEndpoint
from murmur.node.pipeline.service import StageService, StageServiceSettings
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol import pipeline_pb2, pipeline_pb2_grpc, tls
from murmur.protocol.identity import CertificateAuthority
from murmur.protocol.runconfig import OptimSection
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata

RUN = "chunk-test"
CFG = dataclasses.replace(model_config("tiny", n_layers=2, dim=128, hidden_dim=256, seq_len=64), tie_embeddings=False)
OPTIM = OptimSection(lr=1e-3, warmup_steps=0, grad_clip=0.0)
ROWS, T = 8, 64  # an fp32 activation of 256 KiB
CAP = 96 << 10  # the message cap: every activation needs at least three chunks
MAX_PAYLOAD = 1 << 20


@pytest.fixture
def pipeline():
    ca = CertificateAuthority.create("chunk-test")
    loop = LoopThread()
    services, client = [], None
    try:
        for span in split_layers(CFG.n_layers, 2):
            worker = StageWorker(build_stage(CFG, 5, span), OPTIM, target_samples=1000)
            svc = StageService(ca.issue(), worker, run_id=RUN, settings=StageServiceSettings(
                max_rows=ROWS, max_message_bytes=CAP, max_payload_bytes=MAX_PAYLOAD))
            loop.run(svc.start())
            services.append(svc)
        client_id = ca.issue()
        client = StageClient(client_id, run_id=RUN, max_message_bytes=CAP, max_payload_bytes=MAX_PAYLOAD)
        peers = [StageEndpoint(s.identity.node_id, s.address, s.span.index) for s in services]
        yield loop, services, client, peers, client_id
    finally:
        if client is not None:
            loop.run(client.aclose())
        for s in services:
            loop.run(s.stop())
        loop.stop()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, CFG.vocab_size, (ROWS, T), generator=g) for _ in range(2))


def test_a_payload_above_the_cap_crosses_a_stage_boundary_intact(pipeline):
    loop, services, client, peers, _ = pipeline
    x, y = batch()
    local = [StageWorker(build_stage(CFG, 5, s.span), OPTIM, target_samples=1000) for s in services]
    h_local = local[0].forward(x)
    back_local = local[1].backward(h_local, targets=y)
    first_local = local[0].backward(x, grad_outputs=back_local.grad_inputs)
    assert codec.encode(h_local, "fp32").ByteSize() > 2 * CAP  # the test means what it says

    h, wire = loop.run(client.forward(peers[0], "mb0", x, reply_codec="fp32", timeout=60, dim=CFG.dim))
    last = loop.run(client.backward(peers[1], "mb0", h, targets=y, reply_codec="fp32", timeout=60, dim=CFG.dim))
    first = loop.run(client.backward(peers[0], "mb0", x, grad_outputs=last.grad_inputs, reply_codec="fp32",
                                     timeout=60, dim=CFG.dim))
    assert client.streamed == 3 and wire > 2 * CAP
    # fp32 on the wire is exact: what crossed is what the stage computed, bit for bit
    assert torch.equal(h, h_local)
    assert last.loss == pytest.approx(back_local.loss, abs=0)
    assert torch.equal(last.grad_inputs, back_local.grad_inputs)
    assert first.grad_inputs is None
    assert [s.worker.stats.samples_accumulated for s in services] == [ROWS, ROWS]
    # the stage's parameter gradients are the local twin's: the streamed inputs arrived intact
    for remote, mine in zip(services[0].worker.grad_sums, local[0].grad_sums, strict=True):
        assert torch.equal(remote, mine)
    assert first_local.kept
    # and a small payload still goes as one message
    small_x = x[:1, :8]
    loop.run(client.forward(peers[0], "small", small_x, reply_codec="bf16", timeout=60, dim=CFG.dim))
    assert client.streamed == 3


def stream_call(loop, peer: StageEndpoint, client_id, method: str, frame_list):
    """One hand-made streamed call: (status code, details)."""
    async def go():
        async with tls.secure_channel(client_id, peer.address, peer.node_id, max_message_bytes=4 * CAP) as ch:
            call = getattr(pipeline_pb2_grpc.StageStub(ch), method)(iter(frame_list), metadata=version_metadata(),
                                                                      timeout=30)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""
    return loop.run(go())


def hidden(rows=ROWS, nan_at=None):
    h = torch.randn(rows, T, CFG.dim)
    if nan_at is not None:
        h.view(-1)[nan_at] = float("nan")
    return codec.encode(h, "fp32")


def backward_request(inputs, targets=None):
    return pipeline_pb2.BackwardRequest(
        protocol_version=PROTOCOL_VERSION, run_id=RUN, stage=1, microbatch="bad", inputs=inputs,
        targets=targets if targets is not None else codec.encode(batch()[1], "tokens"), reply_codec="fp32",
    )


def framed(request, cap=CAP):
    return list(chunks.frames(request, "backward_request", cap))


def test_bad_chunk_streams_are_refused_with_one_line_and_the_stage_keeps_serving(pipeline):
    loop, services, client, peers, client_id = pipeline
    good = framed(backward_request(hidden()))
    header, body = good[0], good[1:]
    assert len(body) >= 3
    swapped = [header, body[1], body[0], *body[2:]]
    overrun = pipeline_pb2.StageFrame()
    overrun.CopyFrom(body[-1])
    overrun.chunk.offset += len(overrun.chunk.data)
    unknown = pipeline_pb2.StageFrame()
    unknown.CopyFrom(body[0])
    unknown.chunk.part = "scales"
    odd = pipeline_pb2.StageFrame()
    odd.CopyFrom(body[0])
    odd.chunk.data = odd.chunk.data[:-1]
    lying = pipeline_pb2.StageFrame()
    lying.CopyFrom(header)
    lying.backward_request.inputs.parts[0].shape[:] = [ROWS * T * CFG.dim * 2]
    wrong_dtype = pipeline_pb2.StageFrame()
    wrong_dtype.CopyFrom(header)
    wrong_dtype.backward_request.inputs.parts[0].dtype = "float64"
    cases = {
        "chunk before the header": ([*body], grpc.StatusCode.INVALID_ARGUMENT, "expected a backward_request header"),
        "no frames": ([], grpc.StatusCode.INVALID_ARGUMENT, "ended before"),
        "a second header": ([header, header, *body], grpc.StatusCode.INVALID_ARGUMENT, "only chunks"),
        "out of order": (swapped, grpc.StatusCode.INVALID_ARGUMENT, "out of order"),
        "overrun": ([header, *body, overrun], grpc.StatusCode.RESOURCE_EXHAUSTED, "overrun"),
        "truncated": ([header, *body[:-1]], grpc.StatusCode.INVALID_ARGUMENT, "unfilled"),
        "unknown part": ([header, unknown, *body[1:]], grpc.StatusCode.INVALID_ARGUMENT, "no such part"),
        "partial element": ([header, odd], grpc.StatusCode.INVALID_ARGUMENT, "whole float32"),
        "nan in a chunk": (framed(backward_request(hidden(nan_at=ROWS * T * CFG.dim - 3))),
                           grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
        "part larger than its tensor": ([lying, *body], grpc.StatusCode.INVALID_ARGUMENT, "more than"),
        "dtype against its codec": ([wrong_dtype, *body], grpc.StatusCode.INVALID_ARGUMENT, "float64"),
        "shape the stage does not take": (framed(backward_request(codec.encode(torch.randn(ROWS, T, 3), "fp32"))),
                                          grpc.StatusCode.INVALID_ARGUMENT, "expected"),
        "too many rows": (framed(backward_request(hidden(ROWS + 1))), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "oversized"),
        "forward to the last stage": (list(chunks.frames(pipeline_pb2.ForwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=RUN, stage=1, inputs=hidden()), "forward_request", CAP)),
            grpc.StatusCode.FAILED_PRECONDITION, "evaluates targets"),
    }
    for name, (frame_list, code, words) in cases.items():
        method = "ForwardStream" if name.startswith("forward") else "BackwardStream"
        got, details = stream_call(loop, peers[1], client_id, method, frame_list)
        assert got == code, (name, got, details)
        assert words in details and "\n" not in details, (name, details)
    assert len(services[1].refusals) == len(cases)
    assert services[1].worker.stats.backwards == 0
    # A limit below the payload refuses it before any data is taken.
    services[1].settings.max_payload_bytes = 64 << 10
    got, details = stream_call(loop, peers[1], client_id, "BackwardStream", good)
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "pipeline.max_payload_mb" in details, details
    services[1].settings.max_payload_bytes = MAX_PAYLOAD
    # the well-formed stream is computed, and the stage serves on
    assert stream_call(loop, peers[1], client_id, "BackwardStream", good) == (grpc.StatusCode.OK, "")
    x, y = batch()
    h, _ = loop.run(client.forward(peers[0], "ok", x, reply_codec="fp32", timeout=60, dim=CFG.dim))
    last = loop.run(client.backward(peers[1], "ok", h, targets=y, reply_codec="fp32", timeout=60, dim=CFG.dim))
    assert torch.isfinite(last.grad_inputs).all() and services[1].worker.stats.samples_accumulated == 2 * ROWS


def test_a_reply_over_the_clients_payload_limit_is_refused(pipeline):
    loop, _, client, peers, client_id = pipeline
    small = StageClient(client_id, run_id=RUN, max_message_bytes=CAP, max_payload_bytes=64 << 10)
    try:
        with pytest.raises(chunks.ChunkError, match="max_payload_mb"):
            loop.run(small.forward(peers[0], "big", batch()[0], reply_codec="fp32", timeout=60, dim=CFG.dim))
    finally:
        loop.run(small.aclose())
