"""The coordinator's heartbeat datagrams: one UDP socket on its loop, answered by the stream's handler.

A node that was offered the datagram address (its Join reply, its gRPC heartbeat replies) sends
each heartbeat as one signed datagram (protocol/heartbeat_datagram.py). This endpoint checks it,
calls the same handler a heartbeat on the stream gets (service.py ``_heartbeat``, with the node id
the key vouched for), and answers with one signed datagram. Membership, leases, the trainer view
and stage reports behave as on the stream.

What is dropped, silently and counted (``dropped[reason]``, metrics
``murmur_heartbeat_datagrams_dropped_total``): anything oversized or malformed, a tag that fails
(a forged or corrupted datagram, or a key of an earlier coordinator process: its node falls back
to gRPC, whose reply carries the new key), and a counter not above the last accepted from that
node (a replay). Nothing unauthenticated is ever answered, so the port cannot reflect or amplify
traffic at a third party. An authenticated beat the handler refuses (unknown node, banned, run
not found...), or whose reply would not fit a datagram, is answered "use gRPC": the node makes
that heartbeat over gRPC at once, where a refusal keeps its status and a reply goes whole.

The secret is random per process and stored nowhere: a restarted coordinator's keys differ.

Each beat answered is timed (``latency``, coordinator/latency.py; ``murmur_heartbeat_datagram_seconds``
on /metrics): from the datagram's arrival, as the kernel stamped it (SO_TIMESTAMPNS, Linux), to its
reply handed to the kernel, so a beat that waited in the receive buffer while the loop ran other
work counts that wait. It is the coordinator's share of what a node sees.

Not asyncio's datagram transport: it reads one datagram per turn of the loop, so at 10,000 beats
a second the loop would have to turn 10,000 times a second besides its gRPC work. A reader on the
loop drains the socket instead (up to ``DRAIN_MAX`` datagrams a turn), and the socket's receive
buffer holds a stall's worth of them (``RECEIVE_BUFFER_BYTES``), or the kernel drops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import secrets
import socket
import struct
import sys
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from murmur.errors import MurmurError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import heartbeat_datagram as hd

from .latency import Histogram
from .preserialized import BeatReply

Handler = Callable[[str, pb.HeartbeatRequest], BeatReply]
DROP_REASONS = ("oversized", "malformed", "bad_tag", "replay")
DRAIN_MAX = 256  # datagrams one turn of the loop reads at most: the gRPC calls get their turns too
# Asked of the kernel for the socket (it caps it at net.core.rmem_max: 4 MiB on the build machines,
# 208 KiB by default on many hosts); each queued datagram takes about a kilobyte of it, so 8 MiB
# would hold almost a second of 10,000 beats while the loop is busy elsewhere.
RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024
# The kernel's receive timestamp of each datagram, as a struct timespec in the ancillary data. Python
# names neither constant; 35 is SO_TIMESTAMPNS (and SCM_TIMESTAMPNS) on Linux's common ABIs (x86,
# ARM), with a 64-bit timespec on 64-bit machines. Elsewhere a beat is timed from when it is read.
SO_TIMESTAMPNS = 35 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0
_TIMESPEC = struct.Struct("@qq")
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)


class HeartbeatDatagrams:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self._secret = secrets.token_bytes(32)
        self._keys: dict[str, bytes] = {}  # derived once per node: an HMAC less per beat
        self._last: dict[str, int] = {}  # node id -> the last counter accepted from it
        self.served = 0  # beats answered with their reply
        self.use_grpc = {"refused": 0, "too_large": 0}  # beats answered "use gRPC", by why
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.latency = Histogram()  # arrival to reply sent, per beat answered (see the module's docstring)
        self._stamped = False  # the kernel stamps arrivals (SO_TIMESTAMPNS took)
        self._sock: socket.socket | None = None
        self.address = ""  # HOST:PORT nodes send to, once bound (server.py)

    def key_for(self, node_id: str) -> bytes:
        key = self._keys.get(node_id)
        if key is None:
            key = self._keys[node_id] = hd.node_key(self._secret, node_id)
        return key

    async def start(self, host: str, port: int, advertise: str) -> int:
        """Bind HOST:PORT (0: a free port) and serve on this loop; returns the port (OSError: cannot)."""
        loop = asyncio.get_running_loop()
        family, _, _, _, where = (await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM))[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(OSError):  # a smaller buffer only drops more under a stall
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            if SO_TIMESTAMPNS:
                with contextlib.suppress(OSError):  # without it, beats are timed from when they are read
                    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                    self._stamped = True
            sock.setblocking(False)
            sock.bind(where)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        loop.add_reader(sock.fileno(), self._drain)
        bound = sock.getsockname()[1]
        self.address = f"{advertise}:{bound}"
        return int(bound)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(DRAIN_MAX):
            try:  # a longer datagram than the largest reads as oversized
                data, ancillary, _, addr = sock.recvmsg(hd.MAX_DATAGRAM_BYTES + 1, _ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error for an earlier reply: nothing to do
                continue
            arrived = _arrival(ancillary) if self._stamped else time.time()
            answer = self.datagram_received(data, addr)
            if answer is not None:
                with contextlib.suppress(OSError):  # a full send buffer drops it: the node falls back
                    sock.sendto(answer, addr)
                    self.latency.observe(time.time() - arrived)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> bytes | None:
        """The answer to one datagram, or None: dropped."""
        try:
            beat = hd.decode_beat(data)
        except hd.BadDatagram as bad:
            self.dropped[bad.reason] += 1
            return None
        key = self._keys.get(beat.node_id)  # a node id never handed a key has no entry: no work for forgers
        if key is None or not beat.verify(key):
            self.dropped["bad_tag"] += 1
            return None
        if beat.counter <= self._last.get(beat.node_id, 0):
            self.dropped["replay"] += 1
            return None
        self._last[beat.node_id] = beat.counter
        try:
            request = pb.HeartbeatRequest.FromString(beat.request)
            answer = self.handler(beat.node_id, request)
        except (DecodeError, MurmurError):  # not a HeartbeatRequest, or refused: gRPC says why, by status
            reply: bytes | None = None
            self.use_grpc["refused"] += 1
        else:
            # Sized before it is assembled: a whole view's members are bytes of a known length, so a
            # reply of 10,000 trainers is never put together only to be found too large.
            if answer.size() > hd.MAX_REPLY_PAYLOAD:  # a whole view, many changes, a ban list...: over gRPC
                reply = None
                self.use_grpc["too_large"] += 1
            else:
                reply = answer.wire()
                self.served += 1
        return hd.encode_reply(key, beat.counter, reply)


def _arrival(ancillary: list[tuple[int, int, bytes]]) -> float:
    """The kernel's arrival time of a datagram (Unix seconds), from recvmsg's ancillary data; now
    if it carries none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return sec + nsec * 1e-9
    return time.time()
