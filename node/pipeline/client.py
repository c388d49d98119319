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
from murmur.protocol import pipeline_pb2, pipeline_pb2_grpc, tls
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


@dataclass(slots=True)
class BackwardAnswer:
    grad_inputs: torch.Tensor | None
    loss: float
    stepped: bool
    wire_bytes: int  # request + reply, as serialized


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
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def _stub(self, peer: StageEndpoint) -> pipeline_pb2_grpc.StageStub:
        key = (peer.node_id, peer.address)
        channel = self._channels.get(key)
        if channel is None:
            channel = tls.secure_channel(
                self.identity, peer.address, peer.node_id,
                ban_list=self.ban_list, max_message_bytes=self.max_message_bytes,
            )
            self._channels[key] = channel
        return pipeline_pb2_grpc.StageStub(channel)

    async def forward(
        self, peer: StageEndpoint, microbatch: str, inputs: torch.Tensor, *, reply_codec: str, timeout: float,
        dim: int, evaluation: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """The stage's outputs (fp32) and the bytes that crossed the wire. ``evaluation``: no
        backward follows (the stage neither holds nor counts it at its step boundary)."""
        request = pipeline_pb2.ForwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=peer.stage, microbatch=microbatch,
            inputs=codec.encode(inputs, _codec_for(inputs, reply_codec)), reply_codec=reply_codec,
            evaluation=evaluation,
        )
        shape = (*inputs.shape[:2], dim)
        size = request.ByteSize()
        if self._stream(size, _activation_bytes(shape, reply_codec)):
            reply, wire = await self._streamed(peer, "Forward", request, {"outputs": shape}, timeout)
        else:
            reply = await self._stub(peer).Forward(request, metadata=version_metadata(), timeout=timeout)
            wire = size + reply.ByteSize()
        out = codec.decode(reply.outputs, shape=shape, what=f"outputs of {peer.node_id}")
        return out, wire

    async def evaluate(
        self, peer: StageEndpoint, microbatch: str, inputs: torch.Tensor, targets: torch.Tensor, *,
        activation_codec: str, timeout: float,
    ) -> tuple[float, int]:
        """The last stage's mean loss of ``targets`` (nothing trained) and the bytes on the wire."""
        request = pipeline_pb2.ForwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=peer.stage, microbatch=microbatch,
            inputs=codec.encode(inputs, _codec_for(inputs, activation_codec)), reply_codec=activation_codec,
            targets=codec.encode(targets, "tokens"),
        )
        size = request.ByteSize()
        if self._stream(size, 0):  # the reply is one number; the inputs may be any size
            reply, wire = await self._streamed(peer, "Forward", request, {}, timeout)
        else:
            reply = await self._stub(peer).Forward(request, metadata=version_metadata(), timeout=timeout)
            wire = size + reply.ByteSize()
        return reply.loss, wire

    async def backward(
        self, peer: StageEndpoint, microbatch: str, inputs: torch.Tensor, *,
        grad_outputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
        reply_codec: str, timeout: float, dim: int, run_tokens: int = 0,
    ) -> BackwardAnswer:
        request = pipeline_pb2.BackwardRequest(
            protocol_version=PROTOCOL_VERSION, run_id=self.run_id, stage=peer.stage, microbatch=microbatch,
            inputs=codec.encode(inputs, _codec_for(inputs, reply_codec)), reply_codec=reply_codec,
            run_tokens_committed=run_tokens,
        )
        if grad_outputs is not None:
            request.grad_outputs.CopyFrom(codec.encode(grad_outputs, reply_codec))
        if targets is not None:
            request.targets.CopyFrom(codec.encode(targets, "tokens"))
        shape = (*inputs.shape[:2], dim)
        expected = {} if peer.stage == 0 else {"grad_inputs": shape}
        size = request.ByteSize()
        if self._stream(size, _activation_bytes(shape, reply_codec) if expected else 0):
            reply, wire = await self._streamed(peer, "Backward", request, expected, timeout)
        else:
            reply = await self._stub(peer).Backward(request, metadata=version_metadata(), timeout=timeout)
            wire = size + reply.ByteSize()
        grad = None
        if reply.HasField("grad_inputs"):
            grad = codec.decode(reply.grad_inputs, shape=shape, what=f"grad_inputs of {peer.node_id}")
        return BackwardAnswer(grad, reply.loss, reply.stepped, wire)

    def _stream(self, request_bytes: int, reply_bytes: int) -> bool:
        # The request's size is counted once per call and kept for the wire tally: upb's ByteSize
        # serializes the whole message (an activation) to count it.
        return chunks.needs_stream(max(request_bytes, reply_bytes), self.max_message_bytes)

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
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


def _activation_bytes(shape: tuple[int, ...], codec_name: str) -> int:
    """The encoded size of an activation of ``shape`` (to pick the streamed call before sending)."""
    n = math.prod(shape)
    return {"fp32": 4 * n, "bf16": 2 * n, "int8": n + 4 * math.ceil(n / codec.INT8_BLOCK)}.get(codec_name, 4 * n)


def _codec_for(t: torch.Tensor, activation_codec: str) -> str:
    return "tokens" if not t.is_floating_point() else activation_codec

