"""The calling side of one Exchange stream: this peer's input to one owner, and the owner's answer.

`Sender.call_owner` opens the stream, sends the header (operation, attempt, member list, layout,
span, weight, declared size), then the input: a reduce's span chunk by chunk while the reduced
chunks come back (node/exchange/send_reduce.py), a gather's whole payload in frames. It returns
the owner's answer as a `Reply`; a stream that broke, stalled or was refused at the door is a
Reply with code ERROR and the reason, never an exception (only an injected exit raises).

Faults (node/net/faults.py) strike here: a NaN, a wrong shape or garbage in the first chunk, a
poisoned update, a declared size over the limit, another protocol version, a lost result, death
after (or halfway through) sending the input, a delay before the input goes out.
"""

from __future__ import annotations

import asyncio

import grpc

from murmur.node.exchange.attempt import Attempt
from murmur.node.exchange.calls import (
    ERROR,
    AttemptProgress,
    Call,
    GatherCall,
    ReduceCall,
    Reply,
    grpc_reason,
    reply_of,
)
from murmur.node.exchange.channels import Channels
from murmur.node.exchange.send_reduce import Leg, ReduceStream, ResultReader, StreamEnv, declared_bytes
from murmur.protocol import peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BannedError
from murmur.protocol.version import PROTOCOL_VERSION, VERSION_METADATA_KEY
from murmur.protocol.wire import split


class Sender:
    def __init__(self, *, peer_id: str, run_id: str, channels: Channels, env: StreamEnv) -> None:
        self.peer_id, self.run_id, self.channels, self.env = peer_id, run_id, channels, env

    async def call_owner(self, call: Call, att: Attempt, owner: str, progress: AttemptProgress) -> Reply:
        """Our input of this attempt to ``owner``, and its answer."""
        span = call.span_of(att.owners, owner) if isinstance(call, ReduceCall) else (0, 0)
        header = await self._header(call, att, span)
        if await call.faults.delay("open_input", target=owner):
            call.faults.held_input()
        rpc = None
        try:
            rpc = self._open(call, owner, header.protocol_version)
            await self.env.write(rpc, peer_pb2.ExchangeFrame(header=header))
            if isinstance(call, ReduceCall) and not call.faults.oversize:
                delivered = lambda: self._delivered(call, owner, progress)  # noqa: E731 - a callback
                return await ReduceStream(self.env, Leg(call, owner, span, progress), rpc, delivered).run()
            return await self._send_whole(call, owner, span, rpc, progress)
        except grpc.aio.AioRpcError as err:
            return Reply(ERROR, reason=grpc_reason(err))
        except asyncio.InvalidStateError:  # the callee ended the call while we were still writing
            code, details = await rpc.code(), await rpc.details()  # type: ignore[union-attr]
            return Reply(ERROR, reason=f"{code.name}: {details}")
        except TimeoutError:
            return self.env.stalled()
        except BannedError as err:
            return Reply(ERROR, reason=str(err))
        finally:
            if rpc is not None and not rpc.done():
                rpc.cancel()

    async def _header(self, call: Call, att: Attempt, span: tuple[int, int]) -> peer_pb2.ExchangeHeader:
        if isinstance(call, ReduceCall):
            declared = await asyncio.to_thread(declared_bytes, call.codec, call.ranges(span))
        else:
            assert isinstance(call, GatherCall)
            declared = len(call.payload)
        return peer_pb2.ExchangeHeader(
            protocol_version=call.faults.protocol_version(PROTOCOL_VERSION),
            run_id=self.run_id,
            op=call.op,
            round=call.round_id,
            key=call.key,
            attempt=att.number,
            members=list(att.members),
            sender=self.peer_id,
            weight=call.weight,
            layout_hash=call.layout,
            span_start=span[0],
            span_end=span[1],
            payload_bytes=call.faults.declared_bytes(declared, self.env.settings.max_payload_bytes),
        )

    def _open(self, call: Call, owner: str, version: int):
        tls.check_dial(owner, self.channels.ban_list)
        stub = peer_pb2_grpc.PeerStub(self.channels.get(owner, call.peers[owner]))
        return stub.Exchange(
            metadata=((VERSION_METADATA_KEY, str(version)),),
            timeout=max(call.deadline - asyncio.get_running_loop().time(), 0.001),
        )

    async def _send_whole(
        self, call: Call, owner: str, span: tuple[int, int], rpc, progress: AttemptProgress
    ) -> Reply:
        """A gather's payload in frames (with the ``oversize`` fault: nothing past the header),
        then the owner's answer."""
        if isinstance(call, GatherCall) and not call.faults.oversize:
            for piece in split(call.payload, self.env.settings.frame_bytes):
                await self.env.write(rpc, peer_pb2.ExchangeFrame(data=piece))
                progress.moved()
            call.sent += len(call.payload)
        await rpc.done_writing()
        self._delivered(call, owner, progress)
        if isinstance(call, ReduceCall):
            return await ResultReader(self.env, Leg(call, owner, span, progress)).read(rpc)
        return await read_status(rpc, progress)

    @staticmethod
    def _delivered(call: Call, owner: str, progress: AttemptProgress) -> None:
        if progress.deliver(owner):
            call.faults.input_delivered()


async def read_status(rpc, progress: AttemptProgress) -> Reply:
    reply = await rpc.read()
    if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "status":
        return Reply(ERROR, reason="closed the stream without a status")
    progress.moved()
    return reply_of(reply.status)
