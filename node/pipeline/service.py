"""The stage service: one stage of the pipelined model behind gRPC with mutual TLS.

Every handler starts at the door, as the peer server's do (node/net/server.py): the caller's
certificate, already verified against the run's CA by the TLS handshake, must name a node that
is not banned (else PERMISSION_DENIED; a caller with no certificate never gets past the
handshake), and the protocol version in the metadata must be ours (else FAILED_PRECONDITION).
Then the request itself: the run and the stage it names must be this peer's (FAILED_PRECONDITION
naming both), the microbatch may hold at most ``max_rows`` rows of at most the model's seq_len
tokens (RESOURCE_EXHAUSTED), and every tensor must decode to exactly the shape the stage expects,
with finite values and token ids inside the vocabulary (INVALID_ARGUMENT with the reason). A
refused call changes nothing and the stage keeps serving; each refusal is counted and logged.

The computation runs in one compute thread (`StageWorker`, one call at a time) so the event loop
keeps answering; ``queue`` counts the calls waiting for it and the one it computes. A Backward is
accumulated only while its caller still waits for the answer (a hop the driver timed out and
retried elsewhere is not counted twice; one still queued when its caller gives up is not computed
at all); see docs/pipeline.md for the window this leaves.

A request or reply above one gRPC message (``max_message_bytes``, the run's
``pipeline.message_cap_mb``) travels through ForwardStream / BackwardStream as a header and byte
chunks (node/pipeline/chunks.py), checked before and while it arrives, then exactly as a unary
call's. The streamed handlers answer in chunks too, whatever the reply's size.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from murmur.node.net.faults import FaultInjector
from murmur.node.net.server import start_mtls_server
from murmur.node.pipeline import chunks, codec
from murmur.node.pipeline.step_gate import StepGate
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol import pipeline_pb2, pipeline_pb2_grpc, tls
from murmur.protocol.identity import BanList, BannedError, Identity, IdentityError
from murmur.protocol.version import VERSION_METADATA_KEY, VersionMismatch, check_version
from murmur.protocol.wire import WireError

log = logging.getLogger(__name__)

THROUGHPUT_EMA_ALPHA = 0.1  # as SWARM's throughput estimate


def _metadata_value(metadata, key: str):
    """The value of ``key`` in a call's metadata (None if absent), read without building a dict."""
    for k, v in metadata or ():
        if k == key:
            return v
    return None


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass(kw_only=True, slots=True)
class StageServiceSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the real one is in ``address``
    max_rows: int = 64  # rows of one microbatch; more is refused as oversized
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES  # one gRPC message; bigger payloads stream
    max_payload_bytes: int = 1 << 30  # the most one streamed request may carry (node/pipeline/chunks.py)
    stop_grace: float = 1.0
    # A forward whose backward has not come this long after it was admitted is no longer awaited
    # at the step boundary (node/pipeline/step_gate.py); the run's pipeline.hop_timeout_s.
    step_expire_s: float = 30.0


class StageService(pipeline_pb2_grpc.StageServicer):
    def __init__(
        self,
        identity: Identity,
        worker: StageWorker,
        *,
        run_id: str,
        ban_list: BanList | None = None,
        settings: StageServiceSettings | None = None,
        faults: FaultInjector | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.identity, self.worker, self.run_id = identity, worker, run_id
        self.on_progress = on_progress  # a Backward's run_tokens_committed (the run's schedule)
        self.faults = faults  # the ``delay`` fault at point ``stage_compute``: a slow machine
        # The node id, derived once: `Identity.node_id` hashes the public key at every read, and the
        # fault hook asks for it at every computation.
        self._node_id = identity.node_id
        self.ban_list = ban_list if ban_list is not None else BanList()
        self.settings = settings or StageServiceSettings()
        self.refusals: list[tuple[str, str]] = []  # (who, reason)
        self.queue = 0
        self._queue_lock = threading.Lock()
        self.samples_per_s = 0.0  # bias-corrected EMA of compute throughput
        self._ema_raw, self._ema_n = 0.0, 0
        self._server: grpc.aio.Server | None = None
        self.address = ""
        # One thread computes, calls queue for it (the worker computes one at a time anyway): a
        # thread of the shared pool per waiting call only adds threads that contend for the GIL.
        self._compute_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.gate = self._gate_of(worker)

    def _gate_of(self, worker: StageWorker) -> StepGate:
        return StepGate(lambda: worker.stats.samples_accumulated, worker.target_samples,
                        expire_s=self.settings.step_expire_s)

    @property
    def span(self):
        return self.worker.span

    def switch(self, worker: StageWorker) -> None:
        """Serve another stage from the next call on (a call computing now finishes on the old
        worker: its caller asked for that stage). The throughput estimate starts over."""
        self.worker = worker
        old, self.gate = self.gate, self._gate_of(worker)  # the new stage's steps; the old one's held forwards expire
        self.gate.held, self.gate.expired = old.held, old.expired  # counts over the peer's life
        self._ema_raw, self._ema_n, self.samples_per_s = 0.0, 0, 0.0

    async def start(self) -> str:
        s = self.settings
        self._server, self.address = await start_mtls_server(
            pipeline_pb2_grpc.add_StageServicer_to_server, self,
            self.identity, s.host, s.port, tls.server_options(s.max_message_bytes), "the stage service",
        )
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(self.settings.stop_grace)
            self._server = None
        self._compute_thread.shutdown(wait=False, cancel_futures=True)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- the door --------------------------------------------------------------------------------

    def _admit(self, context: grpc.aio.ServicerContext) -> str:
        try:
            peer_id = tls.authenticated_peer(context.auth_context(), self.ban_list)
        except BannedError as err:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        except IdentityError as err:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, str(err)) from None
        try:
            check_version(_metadata_value(context.invocation_metadata(), VERSION_METADATA_KEY), who="caller")
        except VersionMismatch as err:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
        return peer_id

    def _check_target(self, run_id: str, stage: int) -> None:
        if run_id != self.run_id:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run mismatch: this peer serves run {self.run_id!r}, the call is for {run_id!r}",
            )
        if stage != self.span.index:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"wrong stage: this peer serves stage {self.span.index} of {self.span.count}, "
                f"the call is for stage {stage}",
            )

    def _rows_and_len(self, msg) -> tuple[int, int]:
        """The microbatch's rows and sequence length as the inputs declare them, bounded."""
        shape = list(msg.shape)
        want_dims = 2 if self.span.is_first else 3
        if len(shape) != want_dims:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"inputs: shape {shape}, stage {self.span.index} takes {want_dims} dimensions",
            )
        rows, t = shape[0], shape[1]
        cfg = self.worker.module.cfg
        if rows > self.settings.max_rows or t > cfg.seq_len:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"oversized microbatch: {rows} x {t} tokens, at most {self.settings.max_rows} x {cfg.seq_len}",
            )
        if rows < 1 or t < 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"inputs: empty shape {shape}")
        return rows, t

    def _decode(self, msg, shape: tuple[int, ...], what: str) -> torch.Tensor:
        try:
            t = codec.decode(msg, shape=shape, what=what)
        except WireError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        if t.dtype == torch.int64:
            vocab = self.worker.module.cfg.vocab_size
            lo, hi = torch.aminmax(t) if t.numel() else (0, 0)  # one pass, where min and max took two
            if int(lo) < 0 or int(hi) >= vocab:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: token ids outside [0, {vocab})")
        return t

    def _inputs_shape(self, request) -> tuple[int, ...]:
        rows, t = self._rows_and_len(request.inputs)
        return (rows, t) if self.span.is_first else (rows, t, self.worker.module.cfg.dim)

    def _inputs(self, request) -> torch.Tensor:
        rows, t = self._rows_and_len(request.inputs)
        if self.span.is_first:
            if request.inputs.codec != "tokens":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "inputs: stage 0 takes token ids (codec tokens)")
            return self._decode(request.inputs, (rows, t), "inputs")
        if request.inputs.codec == "tokens":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"inputs: stage {self.span.index} takes hidden states")
        return self._decode(request.inputs, (rows, t, self.worker.module.cfg.dim), "inputs")

    def _reply_codec(self, name: str) -> str:
        name = name or "bf16"
        if name not in codec.ACTIVATION_CODECS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown reply codec {name!r}")
        return name

    async def _refuse(self, context, peer_id: str, err: Refused) -> None:
        self.refusals.append((peer_id or "?", err.reason))
        log.warning("refused a call from %s: %s", peer_id or "?", err.reason)
        await context.abort(err.code, err.reason)

    # -- compute ---------------------------------------------------------------------------------

    async def _compute(self, fn, rows: int):
        """``fn()`` in the compute thread, after the calls queued before it. A computation that
        started runs to its end even if the caller gives up (a cancelled handler); one still
        queued is dropped. ``queue`` counts a call until either happens."""
        with self._queue_lock:
            self.queue += 1

        def run():
            t0 = time.perf_counter()
            self._injected_delay()
            result = fn()
            self._measure(rows, time.perf_counter() - t0)
            return result

        def dequeue(_):
            with self._queue_lock:
                self.queue -= 1

        done = self._compute_thread.submit(run)
        done.add_done_callback(dequeue)  # finished, failed or cancelled before it started
        return await asyncio.wrap_future(done)

    def _injected_delay(self) -> None:
        """A slow machine, on purpose: the delay fault sleeps in the compute thread, so a caller
        that gives up meanwhile still sees the computation finish (and not be kept)."""
        if self.faults is not None:
            armed = self.faults.take("delay", self._node_id, 0, point="stage_compute")
            if armed is not None:
                time.sleep(armed.seconds)

    def _measure(self, rows: int, seconds: float) -> None:
        rate = rows / max(seconds, 1e-9)
        self._ema_n += 1
        self._ema_raw = THROUGHPUT_EMA_ALPHA * rate + (1 - THROUGHPUT_EMA_ALPHA) * self._ema_raw
        self.samples_per_s = self._ema_raw / (1 - (1 - THROUGHPUT_EMA_ALPHA) ** self._ema_n)

    # -- handlers --------------------------------------------------------------------------------

    async def Forward(self, request, context):  # noqa: N802
        peer_id = ""
        try:
            peer_id = self._admit(context)
            self._forward_header(request)
            reply_codec, x, targets = self._forward_args(request)
        except Refused as err:
            await self._refuse(context, peer_id, err)
        return await self._forward(x, reply_codec, targets, request)

    async def ForwardStream(self, frames, context):  # noqa: N802
        peer_id = ""
        try:
            peer_id = self._admit(context)
            request = await self._receive(frames, "forward_request", self._forward_header)
            reply_codec, x, targets = self._forward_args(request)
        except Refused as err:
            await self._refuse(context, peer_id, err)
        await self._send(context, await self._forward(x, reply_codec, targets, request), "forward_reply")

    def _forward_header(self, request) -> dict[str, tuple[int, ...]]:
        """The checks a Forward's header passes before its tensors are read; their expected shapes.
        A Forward to the last stage is an evaluation: it carries the targets, and nothing is trained."""
        self._check_target(request.run_id, request.stage)
        if self.span.is_last != request.HasField("targets"):
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a Forward to the last stage evaluates targets (train with Backward); no other stage takes them",
            )
        shape = self._inputs_shape(request)
        if self.span.is_last:
            return {"inputs": shape, "targets": tuple(shape[:2])}
        return {"inputs": shape}

    def _forward_args(self, request):
        reply_codec, x = self._reply_codec(request.reply_codec), self._inputs(request)
        targets = None
        if self.span.is_last:  # an evaluation: the loss of the targets, nothing accumulated
            if request.targets.codec != "tokens":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "targets: the last stage needs token ids")
            targets = self._decode(request.targets, tuple(x.shape[:2]), "targets")
        return reply_codec, x, targets

    async def _forward(
        self, x: torch.Tensor, reply_codec: str, targets: torch.Tensor | None, request
    ) -> pipeline_pb2.ForwardReply:
        t0 = time.perf_counter()
        worker = self.worker  # the stage the call was checked against, even if the peer moves meanwhile
        if targets is not None:
            loss = await self._compute(lambda: worker.evaluate(x, targets), x.shape[0])
            return pipeline_pb2.ForwardReply(loss=loss, compute_s=time.perf_counter() - t0)
        if request.evaluation:  # no backward follows: not part of a step
            out = await self._compute(lambda: worker.forward(x), x.shape[0])
        else:
            # A training forward waits here (not in the compute queue) while it belongs to the
            # next optimizer step, so its backward recomputes on the weights it ran on.
            gate = self.gate
            await gate.admit(request.microbatch, x.shape[0])
            try:
                out = await self._compute(lambda: worker.forward(x), x.shape[0])
            except BaseException:  # failed, or the caller gave up: its backward will not come here
                gate.done(request.microbatch)
                raise
        reply = pipeline_pb2.ForwardReply(compute_s=time.perf_counter() - t0)
        codec.encode_into(reply.outputs, out, reply_codec)
        return reply

    async def Backward(self, request, context):  # noqa: N802
        peer_id = ""
        try:
            peer_id = self._admit(context)
            self._backward_header(request)
            args = self._backward_args(request)
        except Refused as err:
            await self._refuse(context, peer_id, err)
        self._heard(request)
        return await self._backward(request.microbatch, *args)

    async def BackwardStream(self, frames, context):  # noqa: N802
        peer_id = ""
        try:
            peer_id = self._admit(context)
            request = await self._receive(frames, "backward_request", self._backward_header)
            args = self._backward_args(request)
        except Refused as err:
            await self._refuse(context, peer_id, err)
        self._heard(request)
        await self._send(context, await self._backward(request.microbatch, *args), "backward_reply")

    def _heard(self, request) -> None:
        if self.on_progress is not None and request.run_tokens_committed > 0:
            self.on_progress(int(request.run_tokens_committed))

    def _backward_header(self, request) -> dict[str, tuple[int, ...]]:
        self._check_target(request.run_id, request.stage)
        shape = self._inputs_shape(request)
        rows, t = shape[:2]
        if self.span.is_last:
            return {"inputs": shape, "targets": (rows, t)}
        return {"inputs": shape, "grad_outputs": (rows, t, self.worker.module.cfg.dim)}

    def _backward_args(self, request):
        reply_codec = self._reply_codec(request.reply_codec)
        x = self._inputs(request)
        rows, t = x.shape[0], x.shape[1]
        grad_out = targets = None
        if self.span.is_last:
            if request.targets.codec != "tokens":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "targets: the last stage needs token ids")
            targets = self._decode(request.targets, (rows, t), "targets")
        else:
            grad_out = self._decode(request.grad_outputs, (rows, t, self.worker.module.cfg.dim), "grad_outputs")
        return x, grad_out, targets, reply_codec

    async def _backward(self, microbatch: str, x, grad_out, targets, reply_codec) -> pipeline_pb2.BackwardReply:
        rows = x.shape[0]
        t0 = time.perf_counter()
        worker = self.worker  # the stage the call was checked against, even if the peer moves meanwhile
        # The caller may give up (a timeout) while we compute: gRPC then cancels this handler,
        # and the computation, which runs on, is not kept.
        gone = threading.Event()
        try:
            res = await self._compute(
                lambda: worker.backward(x, grad_out, targets, keep=lambda: not gone.is_set()), rows
            )
        except asyncio.CancelledError:
            gone.set()
            raise
        finally:
            self.gate.done(microbatch)  # its forward is no longer awaited at the step boundary
        if res.loss is not None and not math.isfinite(res.loss):
            log.warning("microbatch %s gave a non-finite loss", microbatch)
        reply = pipeline_pb2.BackwardReply(
            loss=res.loss or 0.0,
            stepped=res.stepped,
            optimizer_steps=worker.stats.optimizer_steps,
            compute_s=time.perf_counter() - t0,
        )
        if res.grad_inputs is not None:
            codec.encode_into(reply.grad_inputs, res.grad_inputs, reply_codec)
        return reply

    # -- streamed payloads (node/pipeline/chunks.py) ---------------------------------------------

    async def _receive(self, frames, body: str, check_header):
        s = self.settings
        try:
            return await chunks.receive(frames, body, check_header, max_payload_bytes=s.max_payload_bytes,
                                        max_message_bytes=s.max_message_bytes)
        except (chunks.ChunkError, Refused) as err:
            # Ending the call while the caller still sends reaches it as INTERNAL, not our reason:
            # read (and drop) the rest first. Dropping costs no memory; past DRAIN_FACTOR times
            # what a payload may carry the caller is not honest and gets the broken stream.
            await chunks.drain(frames, chunks.DRAIN_FACTOR * s.max_payload_bytes)
            if isinstance(err, Refused):
                raise
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if err.oversized else grpc.StatusCode.INVALID_ARGUMENT
            raise Refused(code, str(err)) from None

    async def _send(self, context, reply, body: str) -> None:
        for frame in chunks.frames(reply, body, self.settings.max_message_bytes):
            await context.write(frame)

    async def Info(self, request, context):  # noqa: N802
        try:
            self._admit(context)
        except Refused as err:
            await self._refuse(context, "", err)
        return self.info()

    def info(self) -> pipeline_pb2.StageInfo:
        st = self.worker.stats
        return pipeline_pb2.StageInfo(
            node_id=self.identity.node_id,
            run_id=self.run_id,
            stage=self.span.index,
            stages=self.span.count,
            first_block=self.span.first_block,
            end_block=self.span.end_block,
            samples_per_s=self.samples_per_s,
            queue=self.queue,
            forwards=st.forwards,
            backwards=st.backwards,
            optimizer_steps=st.optimizer_steps,
            samples_total=st.samples_total,
            refused=len(self.refusals),
        )

