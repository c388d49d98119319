"""Heartbeats as signed UDP datagrams: the bytes on the wire, both directions, and the node's key.

A heartbeat on a gRPC stream costs the coordinator some 150-250 us of CPU (asyncio, HTTP/2, TLS
records), so 10,000 nodes at 1 Hz need more than two cores for heartbeats alone. A datagram costs
one receive, one HMAC and one send. Liveness over UDP is what cluster-membership systems do
(SWIM, memberlist, Serf); the gRPC stream stays the fallback and carries whatever does not fit.

The node's key is HMAC-SHA256(the coordinator process's secret, node id), handed to the node only
over mutual TLS (its Join reply and its gRPC heartbeat replies), so a datagram signed with it
comes from the holder of that node's certificate. Byte layout (integers big-endian):

    request  version (1) | kind 1 (1) | node id length (1) | node id | counter (8) | HeartbeatRequest | tag (16)
    reply    version (1) | kind 2 or 3 (1)                             | counter (8) | HeartbeatReply   | tag (16)

The tag is HMAC-SHA256 under the node's key over every byte before it, truncated to 16 bytes. The
kind byte tells the directions apart, so a request can never pass for a reply. The counter is the
node's clock in nanoseconds, made strictly increasing (a restarted node process is still above
its last one); the coordinator accepts only a counter above the last it accepted from that node
(no replays), and the reply echoes it, so the node takes only the answer to its own beat. Kind 3
(``USE_GRPC``) carries no reply: the node makes this heartbeat over gRPC now (the reply would
not fit a datagram, or the coordinator refuses the heartbeat, and the refusal keeps its gRPC
status there). Integrity and replay protection only, no confidentiality: the fields are what
the DHT shows anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

VERSION = 1
KIND_BEAT = 1
KIND_REPLY = 2
KIND_USE_GRPC = 3
TAG_BYTES = 16
# Below the smallest MTU an internet path is expected to carry (IPv6's 1,280 less the IP and UDP
# headers), so a datagram is never fragmented: a lost fragment loses the whole datagram.
MAX_DATAGRAM_BYTES = 1232
MAX_NODE_ID_BYTES = 255  # the length byte; node ids are 64 hex digits
_COUNTER = struct.Struct(">Q")
_REQUEST_OVERHEAD = 3 + _COUNTER.size + TAG_BYTES  # plus the node id
_REPLY_HEAD = 2 + _COUNTER.size
MAX_REPLY_PAYLOAD = MAX_DATAGRAM_BYTES - _REPLY_HEAD - TAG_BYTES  # a bigger HeartbeatReply goes over gRPC


class BadDatagram(ValueError):
    """Malformed, oversized or of another version: dropped (``reason`` is the metrics label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def node_key(secret: bytes, node_id: str) -> bytes:
    """The node's heartbeat key: HMAC-SHA256(the coordinator process's secret, node id)."""
    return hmac.new(secret, node_id.encode(), hashlib.sha256).digest()


def _tag(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:TAG_BYTES]


def encode_beat(key: bytes, node_id: str, counter: int, request: bytes) -> bytes:
    """A node's heartbeat datagram; ValueError when it would not fit one (then gRPC)."""
    nid = node_id.encode()
    if len(nid) > MAX_NODE_ID_BYTES:
        raise ValueError(f"node id of {len(nid)} bytes; at most {MAX_NODE_ID_BYTES}")
    body = bytes((VERSION, KIND_BEAT, len(nid))) + nid + _COUNTER.pack(counter) + request
    if len(body) + TAG_BYTES > MAX_DATAGRAM_BYTES:
        raise ValueError(f"a heartbeat of {len(body) + TAG_BYTES} bytes does not fit one datagram")
    return body + _tag(key, body)


@dataclass(slots=True)
class Beat:
    """A request datagram split up; ``verify`` it before believing any of it."""

    node_id: str
    counter: int
    request: bytes
    body: bytes
    tag: bytes

    def verify(self, key: bytes) -> bool:
        return hmac.compare_digest(_tag(key, self.body), self.tag)


def decode_beat(data: bytes) -> Beat:
    """Split a request datagram (not yet authenticated); BadDatagram when it cannot be one."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise BadDatagram("oversized")
    if len(data) < _REQUEST_OVERHEAD or data[0] != VERSION or data[1] != KIND_BEAT:
        raise BadDatagram("malformed")
    n = data[2]
    head = 3 + n + _COUNTER.size
    if len(data) < head + TAG_BYTES:
        raise BadDatagram("malformed")
    try:
        node_id = data[3 : 3 + n].decode()
    except UnicodeDecodeError:
        raise BadDatagram("malformed") from None
    body = data[:-TAG_BYTES]
    return Beat(node_id, _COUNTER.unpack_from(data, 3 + n)[0], data[head:-TAG_BYTES], body, data[-TAG_BYTES:])


def encode_reply(key: bytes, counter: int, reply: bytes | None) -> bytes:
    """The coordinator's answer to beat ``counter``: the serialized HeartbeatReply, or None for
    "make this heartbeat over gRPC" (it would not fit, or the coordinator refuses it)."""
    if reply is not None and len(reply) > MAX_REPLY_PAYLOAD:
        reply = None
    kind = KIND_REPLY if reply is not None else KIND_USE_GRPC
    body = bytes((VERSION, kind)) + _COUNTER.pack(counter) + (reply or b"")
    return body + _tag(key, body)


@dataclass(slots=True)
class Reply:
    counter: int
    reply: bytes | None  # None: make this heartbeat over gRPC


def decode_reply(key: bytes, data: bytes) -> Reply:
    """An authenticated reply; BadDatagram (malformed, or ``bad_tag``) otherwise."""
    if not _REPLY_HEAD + TAG_BYTES <= len(data) <= MAX_DATAGRAM_BYTES or data[0] != VERSION:
        raise BadDatagram("malformed")
    if data[1] not in (KIND_REPLY, KIND_USE_GRPC):
        raise BadDatagram("malformed")
    if not hmac.compare_digest(_tag(key, data[:-TAG_BYTES]), data[-TAG_BYTES:]):
        raise BadDatagram("bad_tag")
    counter = _COUNTER.unpack_from(data, 2)[0]
    return Reply(counter, data[_REPLY_HEAD:-TAG_BYTES] if data[1] == KIND_REPLY else None)


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"heartbeat datagram address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
