"""The exchange's settings, and the layout both sides of a stream must compute alike.

Layout: the flat update is cut into one span per member of the sorted member list (boundaries on
multiples of the alignment); each span into pipeline chunks of ``chunk_mb`` of the fp32 update
(the same alignment), so a chunk is encoded, sent, reduced, sent back and decoded on its own
while later chunks are still on the wire. The alignment is ``span_align`` made a multiple of the
codec's block, so a chunk boundary never splits a quantization block: encoding a span chunk by
chunk gives the same bytes as encoding it whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from murmur.errors import MurmurError
from murmur.protocol import tls

# Slack per chunk in what a sender declares beyond its codec's size for the chunk's length, and
# what a frame may carry beyond 4 bytes per element (names, dtypes, shapes, length prefixes, meta).
CHUNK_OVERHEAD = 1024
FRAME_OVERHEAD = 4096  # room for the ExchangeFrame around one frame's bytes


class ExchangeSettingsError(MurmurError):
    pass


@dataclass(kw_only=True, slots=True)
class ExchangeSettings:
    peer_timeout: float = 30.0  # a member silent this long (no input, no reply) is dropped
    round_deadline: float = 300.0  # one call, every attempt and the catch-up included
    max_payload_bytes: int = 1 << 30  # one member's payload for one call; more is refused unread
    chunk_mb: float = 4.0  # all-reduce pipeline chunk: MB (10^6 bytes) of the fp32 update
    frame_bytes: int = 1 << 20  # frame size of a streamed all-gather payload
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES  # gRPC's own cap on one frame
    stream_window_bytes: int = 16 << 20  # HTTP/2 receive window of our streams (results coming back)
    span_align: int = 4096  # span and chunk boundaries fall on multiples of this many elements
    quorum: float = 0.5  # a round needs more than this fraction of its starting group
    catch_up_poll: float = 0.2  # how often a lagging peer asks whether someone completed
    keep_results: int = 2  # results kept (and served) per key for peers catching up

    def __post_init__(self) -> None:
        for name in ("peer_timeout", "round_deadline", "catch_up_poll", "chunk_mb"):
            if not getattr(self, name) > 0:
                raise ExchangeSettingsError(f"exchange setting {name} must be positive")
        if self.stream_window_bytes < 65536:
            raise ExchangeSettingsError("stream_window_bytes must be at least 64 KiB (HTTP/2's default)")
        if self.span_align < 1:
            raise ExchangeSettingsError("exchange setting span_align must be at least 1")
        if self.frame_bytes < 1 or self.frame_bytes + FRAME_OVERHEAD > self.max_message_bytes:
            raise ExchangeSettingsError("frame_bytes must be positive and leave room under max_message_bytes")
        if 4 * self.chunk_elements(self.span_align) + CHUNK_OVERHEAD + FRAME_OVERHEAD > self.max_message_bytes:
            raise ExchangeSettingsError(
                f"chunk_mb {self.chunk_mb:g} does not fit one frame: a chunk travels as one message, "
                f"at most max_message_bytes {self.max_message_bytes}"
            )
        if not 0 <= self.quorum < 1:
            raise ExchangeSettingsError("quorum is a fraction in [0, 1)")

    def chunk_elements(self, align: int) -> int:
        """Elements per pipeline chunk: ``chunk_mb`` of fp32 rounded down to ``align`` (at least one)."""
        per = int(self.chunk_mb * 1e6 / 4)
        return max(align, per // align * align)


def alignment(span_align: int, codec: object) -> int:
    """``span_align`` made a multiple of the codec's block (if it has one)."""
    block = int(getattr(codec, "block", 1) or 1)
    return math.lcm(span_align, block)


def spans(numel: int, members: int, align: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, one per member, boundaries on multiples of ``align``."""
    per = math.ceil(numel / members / align) * align if numel else 0
    return [(min(i * per, numel), min((i + 1) * per, numel)) for i in range(members)]


def chunk_ranges(length: int, chunk: int) -> list[tuple[int, int]]:
    """[a, b) ranges of at most ``chunk`` elements covering a span of ``length``, relative to its
    start. An empty span is one empty chunk: every member still sends every owner one frame."""
    if length <= 0:
        return [(0, 0)]
    return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]
