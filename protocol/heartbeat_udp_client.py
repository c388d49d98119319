"""The node's side of heartbeat datagrams: send one signed beat, take only its signed answer.

Used by MemberClient (protocol/coordinator_client.py) while the coordinator offers a datagram
address and key (its Join reply and gRPC heartbeat replies). ``beat`` returns the HeartbeatReply,
or None when this heartbeat must go over gRPC: no answer within its wait (``wait_s``; longer
while the coordinator answers late: SLOW_WAIT_S), the coordinator said
"use gRPC" (a refusal, or a reply too large for a datagram), or the request itself does not fit.
A forged or stale datagram is ignored (it cannot end the wait early with a wrong answer: a reply
must carry this beat's counter under the node's key). After ``misses_before_pause`` beats in a
row went unanswered (a firewall that drops UDP, a coordinator restarted with new keys not yet
learnt), datagrams pause for ``pause_s`` and every heartbeat goes over gRPC meanwhile, so a node
that cannot use UDP pays one short wait a minute, not one each beat.

One datagram socket per client, opened with its first datagram beat (never before the node's
DHT forks, as the gRPC stream), connected to the coordinator's address so the kernel keeps
other senders' datagrams away and reports an ICMP "port unreachable" at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from . import coordinator_pb2 as pb
from . import heartbeat_datagram as hd

# How long a beat waits for its datagram answer before it goes over gRPC. A coordinator answers in
# well under a millisecond on a LAN and a round trip on the internet is under 300 ms; a quarter of
# a second keeps the gRPC fallback well inside the heartbeat interval (1 s by default).
WAIT_S = 0.25
MISSES_BEFORE_PAUSE = 3  # unanswered datagram beats in a row that pause datagrams
PAUSE_S = 60.0  # datagrams stay paused this long, then one beat tries them again
# An answer that comes after its beat's wait (signed under this node's key, for one of its earlier
# beats) shows a coordinator that is slow, not a path that loses datagrams: for SLOW_FOR_S a beat
# waits up to SLOW_WAIT_S for its answer before it goes over gRPC, and the late answer counts as
# answered (no pause). Falling back at once made an overloaded coordinator busier: at 10,000
# simulated nodes a third of the beats came again over gRPC, each several times a datagram's cost.
SLOW_WAIT_S = 1.0
SLOW_FOR_S = 30.0


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, owner: DatagramBeats) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.owner._received(data)

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable: nobody listens there
        self.owner._unreachable()


class DatagramBeats:
    def __init__(
        self,
        node_id: str,
        *,
        wait_s: float = WAIT_S,
        misses_before_pause: int = MISSES_BEFORE_PAUSE,
        pause_s: float = PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.wait_s, self.misses_before_pause, self.pause_s = wait_s, misses_before_pause, pause_s
        self.clock = clock
        self.address = ""  # HOST:PORT the coordinator offered ("" none)
        self.key = b""
        self._transport: asyncio.DatagramTransport | None = None
        self._counter = 0
        self._waiting: tuple[int, asyncio.Future[hd.Reply]] | None = None
        self.misses = 0
        self.paused_until = 0.0
        self.slow_until = 0.0  # a late answer came: beats wait SLOW_WAIT_S until then
        self.sent = self.answered = self.use_grpc = self.missed = self.late = 0  # counts, for tests and the benchmark

    def offer(self, address: str, key: bytes) -> None:
        """What a gRPC reply (or the Join reply) offered: a new address reopens the socket. A new
        address or key (a restarted coordinator) ends a pause: the misses were the old key's."""
        if address != self.address:
            self.close()
            self.address = address
            self.misses, self.paused_until = 0, 0.0
        if key != self.key:
            self.key = key
            self.misses, self.paused_until = 0, 0.0

    def usable(self) -> bool:
        return bool(self.address and self.key) and self.clock() >= self.paused_until

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _next_counter(self) -> int:
        # The clock in ns, strictly increasing: a restarted process starts above its last one.
        self._counter = max(self._counter + 1, time.time_ns())
        return self._counter

    async def beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply | None:
        """The reply to ``request`` over a datagram, or None: make this heartbeat over gRPC."""
        try:
            counter = self._next_counter()
            data = hd.encode_beat(self.key, self.node_id, counter, request.SerializeToString())
        except ValueError:  # too big for a datagram (a driver's many measurements): gRPC
            return None
        if self._transport is None:
            try:
                host, port = hd.split_host_port(self.address)
                loop = asyncio.get_running_loop()
                self._transport, _ = await loop.create_datagram_endpoint(  # type: ignore[assignment]
                    lambda: _Endpoint(self), remote_addr=(host, port)
                )
            except (OSError, ValueError):
                self._missed()
                return None
        future: asyncio.Future[hd.Reply] = asyncio.get_running_loop().create_future()
        self._waiting = (counter, future)
        try:
            self._transport.sendto(data)  # type: ignore[union-attr]
            self.sent += 1
            answer = await asyncio.wait_for(future, self.wait())
        except (TimeoutError, OSError, ConnectionError):
            self._missed()
            return None
        finally:
            self._waiting = None
        self.misses = 0
        if answer.reply is None:
            self.use_grpc += 1
            return None
        try:
            reply = pb.HeartbeatReply.FromString(answer.reply)
        except DecodeError:  # signed, yet not a reply this build reads: gRPC answers it
            self.use_grpc += 1
            return None
        self.answered += 1
        return reply

    def wait(self) -> float:
        """How long this beat waits for its datagram answer before it goes over gRPC."""
        return max(self.wait_s, SLOW_WAIT_S) if self.clock() < self.slow_until else self.wait_s

    def _missed(self) -> None:
        self.missed += 1
        self.misses += 1
        if self.misses >= self.misses_before_pause:
            self.misses = 0
            self.paused_until = self.clock() + self.pause_s
            self.close()

    def _received(self, data: bytes) -> None:
        try:
            answer = hd.decode_reply(self.key, data)
        except hd.BadDatagram:  # forged, corrupted or under an old key: not this beat's answer
            return
        waiting = self._waiting
        if waiting is not None and not waiting[1].done() and answer.counter == waiting[0]:
            waiting[1].set_result(answer)
        elif answer.counter <= self._counter:  # an earlier beat's, after its wait: the coordinator is slow
            self.late += 1
            self.misses = 0
            self.slow_until = self.clock() + SLOW_FOR_S

    def _unreachable(self) -> None:
        waiting = self._waiting
        if waiting is not None and not waiting[1].done():
            waiting[1].set_exception(ConnectionRefusedError("nothing listens at the heartbeat datagram address"))
