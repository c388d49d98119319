"""The heartbeat datagram's bytes (protocol/heartbeat_datagram.py): round trips, tags, sizes."""

from __future__ import annotations

import pytest

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import heartbeat_datagram as hd

KEY = hd.node_key(b"s" * 32, "a" * 64)
NODE = "a" * 64


def test_a_beat_round_trips_and_verifies_only_under_its_key():
    request = pb.HeartbeatRequest(tokens_per_s=12.5, incarnation="i", peer_address="10.0.0.1:5", round=3)
    data = hd.encode_beat(KEY, NODE, 1234, request.SerializeToString())
    beat = hd.decode_beat(data)
    assert (beat.node_id, beat.counter) == (NODE, 1234)
    assert pb.HeartbeatRequest.FromString(beat.request) == request
    assert beat.verify(KEY)
    assert not beat.verify(hd.node_key(b"s" * 32, "b" * 64))  # another node's key
    assert not beat.verify(hd.node_key(b"t" * 32, NODE))  # another coordinator process's key


def test_keys_differ_by_node_and_by_secret():
    assert hd.node_key(b"x" * 32, NODE) == hd.node_key(b"x" * 32, NODE)
    assert len({hd.node_key(b"x" * 32, NODE), hd.node_key(b"x" * 32, "b" * 64), hd.node_key(b"y" * 32, NODE)}) == 3


@pytest.mark.parametrize("where", [0, 1, 2, 5, 70, -20, -1])
def test_any_flipped_byte_fails_the_tag_or_the_parse(where):
    data = bytearray(hd.encode_beat(KEY, NODE, 99, pb.HeartbeatRequest(tokens_per_s=1.0).SerializeToString()))
    data[where] ^= 0x01
    try:
        beat = hd.decode_beat(bytes(data))
    except hd.BadDatagram as bad:
        assert bad.reason == "malformed"
        return
    assert not beat.verify(KEY)


def test_truncated_garbage_and_oversized_are_refused_by_reason():
    good = hd.encode_beat(KEY, NODE, 7, b"")
    for data in (b"", b"\x01", good[:10], b"\x02" + good[1:], b"\x01\x02" + good[2:], bytes(range(40))):
        with pytest.raises(hd.BadDatagram) as err:
            hd.decode_beat(data)
        assert err.value.reason == "malformed"
    with pytest.raises(hd.BadDatagram) as err:
        hd.decode_beat(good + b"x" * hd.MAX_DATAGRAM_BYTES)
    assert err.value.reason == "oversized"
    with pytest.raises(ValueError, match="does not fit"):
        hd.encode_beat(KEY, NODE, 7, b"x" * hd.MAX_DATAGRAM_BYTES)


def test_a_reply_round_trips_and_a_too_large_one_says_use_grpc():
    reply = pb.HeartbeatReply(run_state="active", view_version=5, view_unchanged=True)
    answer = hd.decode_reply(KEY, hd.encode_reply(KEY, 42, reply.SerializeToString()))
    assert answer.counter == 42 and pb.HeartbeatReply.FromString(answer.reply) == reply
    big = pb.HeartbeatReply(members=[pb.LiveMember(node_id=f"{i:064x}", peer_address="10.0.0.1:1") for i in range(20)])
    assert len(big.SerializeToString()) > hd.MAX_REPLY_PAYLOAD
    data = hd.encode_reply(KEY, 43, big.SerializeToString())
    assert len(data) <= hd.MAX_DATAGRAM_BYTES
    assert hd.decode_reply(KEY, data) == hd.Reply(43, None)
    assert hd.decode_reply(KEY, hd.encode_reply(KEY, 44, None)) == hd.Reply(44, None)


def test_a_forged_or_reflected_reply_is_refused():
    data = hd.encode_reply(KEY, 42, pb.HeartbeatReply(run_state="finished").SerializeToString())
    with pytest.raises(hd.BadDatagram) as err:
        hd.decode_reply(hd.node_key(b"s" * 32, "b" * 64), data)  # signed under another key
    assert err.value.reason == "bad_tag"
    forged = bytearray(data)
    forged[12] ^= 0x01
    with pytest.raises(hd.BadDatagram):
        hd.decode_reply(KEY, bytes(forged))
    beat = hd.encode_beat(KEY, NODE, 42, b"")  # a node's own request sent back to it is no reply
    with pytest.raises(hd.BadDatagram):
        hd.decode_reply(KEY, beat)
    with pytest.raises(hd.BadDatagram):
        hd.decode_reply(KEY, data[:5])


def test_addresses():
    assert hd.split_host_port("127.0.0.1:7701") == ("127.0.0.1", 7701)
    assert hd.split_host_port("[::1]:7701") == ("::1", 7701)
    for bad in ("", "host", "host:0", "host:x", ":5"):
        with pytest.raises(ValueError):
            hd.split_host_port(bad)
