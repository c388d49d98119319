"""Calls to stage peers: one mutual-TLS channel per peer, reused, closed with the client.

A peer is dialled by the node id it announced (``grpc.ssl_target_name_override``), so the
answer comes from exactly that node whatever its address. The calls raise grpc.aio.AioRpcError;
the driver decides what a failure means (retry elsewhere, or give the microbatch up).

A call whose request or expected reply is above one gRPC message (``max_message_bytes``, the run's
``pipeline.message_cap_mb``) goes through the streamed RPC instead (node/pipeline/chunks.py); a
streamed reply is checked as the service checks a streamed request (WireError if it fails).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import torch

from murmur.node.pipeline import chunks, codec
from murmur.protocol import pipeline_pb2, pipeline_pb2_grpc, tensor_pb2, tls
from murmur.protocol.identity import BanList, Identity
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata


@dataclass(frozen=True, slots=True)
class StageEndpoint:
    """Where a caller reaches one peer of a stage: the node id it announced (the name its TLS
    certificate must carry), its address and the stage it serves. Only the caller's handle: the
    peer itself, which serves the stage, is `StagePeer` (node/pipeline/stage_peer.py)."""

    node_id: str
    address: str
    stage: int


# What a call sends as an activation: a tensor, encoded here, or the message a stage replied with
# (checked, `codec.check`), handed on as it came.
Activation = torch.Tensor | tensor_pb2.WireTensor


@dataclass(slots=True)
class BackwardAnswer:
    grad_wire: tensor_pb2.WireTensor | None  # the gradient of the stage's inputs as it came (checked)
    loss: float
    stepped: bool
    wire_bytes: int  # request + reply, as serialized

    @property
    def grad_inputs(self) -> torch.Tensor | None:
        """The gradient of the stage's inputs, fp32 (None on the first stage)."""
        if self.grad_wire is None:
            return None
        return codec.decode(self.grad_wire, shape=tuple(self.grad_wire.shape), what="grad_inputs")


class StageClient:
    def __init__(
        self,
        identity: Identity,
        *,
        run_id: str,
        ban_list: BanList | None = None,
        max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES,
        max_payload_bytes: int = 1 << 30,
    ) -> None:
        self.identity, self.run_id, self.ban_list = identity, run_id, ban_list
        self.max_message_bytes = max_message_bytes
        self.max_payload_bytes = max_payload_bytes  # the most one streamed reply may carry
        self.streamed = 0  # calls that went as chunk streams (tests, benchmarks)
        self._calls_of: dict[tuple[str, str], _Calls] = {}  # one channel per peer, reused

    def _calls(self, peer: StageEndpoint) -> _Calls:
        key = (peer.node_id, peer.address)
        calls = self._calls_of.get(key)
        if calls is None:
            channel = tls.secure_channel(
                self.identity, peer.address, peer.node_id,
                ban_list=self.ban_list, max_message_bytes=self.max_message_bytes,
            )
            calls = self._calls_of[key] = _Calls(channel)
        return calls

    def _stub(self, peer: StageEndpoint) -> pipeline_pb2_grpc.StageStub:
        return self._calls(peer).stub

    async def forward(
        self, peer: StageEndpoint, microbatch: str, inputs: Activation, *, reply_codec: str, timeout: float,
        dim: int, evaluation: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """The stage's outputs (fp32) and the bytes that crossed the wire. ``evaluation``: no
        backward follows (the stage neither holds nor counts it at its step boundary)."""
        out, wire = await self.forward_wire(peer, microbatch, inputs, reply_codec=reply_codec, timeout=timeout,
                                            dim=dim, evaluation=evaluation)
        return codec.decode(out, shape=tuple(out.shape), what=f"outputs of {peer.node_id}"), wire

    async def forward_wire(
        self, peer: StageEndpoint, microbatch: str, inputs: Activation, *, reply_codec: str, timeout: float,
        dim: int, evaluation: bool = False,
    ) -> tuple[tensor_pb2.WireTensor, int]:
        """As `forward`, the outputs as the stage sent them (checked, not converted): what the
        driver hands on to the next stage."""
        request = pipeline_pb2.ForwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=peer.stage, microbatch=microbatch,
            reply_codec=reply_codec, evaluation=evaluation,
        )
        _put(request.inputs, inputs, reply_codec)
        shape = (*inputs.shape[:2], dim)  # a tensor's or a message's
        reply, wire = await self._call(peer, "Forward", request, _activation_bytes(shape, reply_codec),
                                       {"outputs": shape}, timeout)
        return codec.check(reply.outputs, shape=shape, what=f"outputs of {peer.node_id}"), wire

    async def evaluate(
        self, peer: StageEndpoint, microbatch: str, inputs: Activation, targets: torch.Tensor, *,
        activation_codec: str, timeout: float,
    ) -> tuple[float, int]:
        """The last stage's mean loss of ``targets`` (nothing trained) and the bytes on the wire."""
        request = pipeline_pb2.ForwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=peer.stage, microbatch=microbatch,
            reply_codec=activation_codec,
        )
        _put(request.inputs, inputs, activation_codec)
        codec.encode_into(request.targets, targets, "tokens")
        # the reply is one number; the inputs may be any size
        reply, wire = await self._call(peer, "Forward", request, 0, {}, timeout)
        return reply.loss, wire

    async def backward(
        self, peer: StageEndpoint, microbatch: str, inputs: Activation, *,
        grad_outputs: Activation | None = None, targets: torch.Tensor | None = None,
        reply_codec: str, timeout: float, dim: int, run_tokens: int = 0,
    ) -> BackwardAnswer:
        request = pipeline_pb2.BackwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=peer.stage, microbatch=microbatch,
            reply_codec=reply_codec, run_tokens_committed=run_tokens,
        )
        _put(request.inputs, inputs, reply_codec)
        if grad_outputs is not None:
            _put(request.grad_outputs, grad_outputs, reply_codec)
        if targets is not None:
            codec.encode_into(request.targets, targets, "tokens")
        shape = (*inputs.shape[:2], dim)  # a tensor's or a message's
        expected = {} if peer.stage == 0 else {"grad_inputs": shape}
        reply, wire = await self._call(peer, "Backward", request,
                                       _activation_bytes(shape, reply_codec) if expected else 0, expected, timeout)
        grad = None
        if reply.HasField("grad_inputs"):
            grad = codec.check(reply.grad_inputs, shape=shape, what=f"grad_inputs of {peer.node_id}")
        return BackwardAnswer(grad, reply.loss, reply.stepped, wire)

    async def _call(self, peer: StageEndpoint, call: str, request, reply_bytes: int, expected: dict,
                    timeout: float):
        """``call`` (Forward or Backward) of ``request``: (the reply, the bytes on the wire both ways).
        One gRPC message each way when both fit it, else the chunk streams.

        The unary calls send the request serialized here and take the reply's bytes as they came:
        their lengths are the wire's tally, where the generated stub serialized the request again
        after its size had been counted (upb's ByteSize serializes the whole message to count it),
        and counted the parsed reply the same way."""
        data = request.SerializeToString()
        if chunks.needs_stream(max(len(data), reply_bytes), self.max_message_bytes):
            del data  # the streamed call holds its message plus one chunk, not a second copy
            return await self._streamed(peer, call, request, expected, timeout)
        calls = self._calls(peer)
        raw = await (calls.forward if call == "Forward" else calls.backward)(
            data, metadata=version_metadata(), timeout=timeout)
        reply_type = pipeline_pb2.ForwardReply if call == "Forward" else pipeline_pb2.BackwardReply
        return reply_type.FromString(raw), len(data) + len(raw)

    async def _streamed(self, peer: StageEndpoint, call: str, request, expected: dict, timeout: float):
        """``call`` (Forward or Backward) as a chunk stream: (the reply, wire bytes)."""
        kind = call.lower()
        wire = 0

        def requests():  # one chunk at a time: the sender holds its message plus one chunk
            nonlocal wire
            for frame in chunks.frames(request, f"{kind}_request", self.max_message_bytes):
                wire += frame.ByteSize()
                yield frame

        rpc = getattr(self._stub(peer), f"{call}Stream")(requests(), metadata=version_metadata(), timeout=timeout)

        async def replies():
            nonlocal wire
            async for frame in rpc:
                wire += frame.ByteSize()
                yield frame

        try:
            reply = await chunks.receive(
                replies(), f"{kind}_reply", lambda _: expected, max_payload_bytes=self.max_payload_bytes,
                max_message_bytes=self.max_message_bytes,
            )
        except chunks.ChunkError:
            rpc.cancel()  # the peer stops sending what we refused
            raise
        self.streamed += 1
        return reply, wire

    async def info(self, peer: StageEndpoint, timeout: float = 10.0) -> pipeline_pb2.StageInfo:
        return await self._stub(peer).Info(
            pipeline_pb2.StageInfoRequest(protocol_version=PROTOCOL_VERSION),
            metadata=version_metadata(), timeout=timeout,
        )

    async def aclose(self) -> None:
        calls, self._calls_of = list(self._calls_of.values()), {}
        for c in calls:
            await c.channel.close()


class _Calls:
    """One peer's channel and the calls made on it, built once: the unary Forward and Backward
    take and return serialized bytes (`StageClient._call`); the stub serves the rest."""

    __slots__ = ("channel", "stub", "forward", "backward")

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stub = pipeline_pb2_grpc.StageStub(channel)
        self.forward = channel.unary_unary("/murmur.v1.Stage/Forward", _registered_method=True)
        self.backward = channel.unary_unary("/murmur.v1.Stage/Backward", _registered_method=True)


def _activation_bytes(shape: tuple[int, ...], codec_name: str) -> int:
    """The encoded size of an activation of ``shape`` (to pick the streamed call before sending)."""
    n = math.prod(shape)
    return {"fp32": 4 * n, "bf16": 2 * n, "int8": n + 4 * math.ceil(n / codec.INT8_BLOCK)}.get(codec_name, 4 * n)


def _codec_for(t: torch.Tensor, activation_codec: str) -> str:
    return "tokens" if not t.is_floating_point() else activation_codec


def _put(field: tensor_pb2.WireTensor, value: Activation, activation_codec: str) -> None:
    """Write an activation into a request's (empty) field: a tensor encoded, a message as it came
    (a stage's reply, checked when it arrived)."""
    if isinstance(value, tensor_pb2.WireTensor):
        field.CopyFrom(value)
    else:
        codec.encode_into(field, value, _codec_for(value, activation_codec))
