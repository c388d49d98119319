"""The exchange's reduce-scatter (``GrpcExchange.areduce_scatter``), phase A of a grouped round
(node/exchange/hierarchy.py): real peers on loopback, each owner keeps the reduced block of
columns it owns and nothing goes back, so a member sends about (k-1)/k of its update, not the
butterfly's 2(k-1)/k."""

from __future__ import annotations

import pytest
import torch
from _net_helpers import no_lost_task_exceptions, peer_group  # noqa: F401 - a fixture

from murmur.node.exchange.groups import column_block, column_owner, holders
from murmur.node.exchange.settings import chunk_ranges
from murmur.optim.exchange import ExchangeError
from murmur.protocol import peer_pb2
from murmur.protocol.wire import wire_to_proto

TIMEOUT = 120


def test_column_blocks_are_contiguous_cover_every_column_once_and_match_the_holders():
    for owners, columns in ((4, 4), (3, 8), (5, 16), (16, 16), (6, 4)):
        blocks = [column_block(i, owners, columns) for i in range(owners)]
        assert [c for lo, hi in blocks for c in range(lo, hi)] == list(range(columns))
        assert all(column_owner(c, owners, columns) == i for i, (lo, hi) in enumerate(blocks) for c in range(lo, hi))
        assert max(hi - lo for lo, hi in blocks) == -(-columns // owners)
    ids = [f"n{i}" for i in range(3)]
    assert holders(ids, 8) == {c: ids[column_owner(c, 3, 8)] for c in range(8)}


@pytest.mark.parametrize("columns", [4, 6])
def test_each_owner_keeps_its_block_of_the_mean_and_sends_no_result_back(columns):
    n, numel = 4, 6000
    with peer_group(n, codec="int8") as (loop, peers, _):
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        futs = [loop.submit(p.exchange.areduce_scatter([x], round_id=1, key="a", columns=columns))
                for p, x in zip(peers, xs, strict=True)]
        outs = [f.result(timeout=TIMEOUT) for f in futs]
        mean = torch.stack(xs).mean(0)
        scale = max(x.abs().max().item() for x in xs)
        owners = outs[0].owners
        assert all(o.owners == owners for o in outs) and sorted(owners) == sorted(p.node_id for p in peers)
        covered = []
        for o in outs:
            start, end = o.span
            got = o.result.tensors[0][start:end]
            # int8 twice on the way (the inputs, the owner's re-encoded aggregate).
            assert (got - mean[start:end]).abs().max().item() <= 2 * 2 / 127 * scale
            covered.append((start, end))
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
        # Each member sent its update less its own block, once, and took in its block from the
        # others: no result travels back (the butterfly sends the update twice).
        codec = peers[0].exchange.codec
        rate = sum(
            peer_pb2.Payload(tensors=[wire_to_proto(codec.encode_stateless(torch.zeros(b - a)))]).ByteSize()
            for a, b in chunk_ranges(numel, 64)
        ) / numel
        for o in outs:
            own = o.span[1] - o.span[0]
            assert abs(o.result.bytes_sent - rate * (numel - own)) <= 0.05 * rate * numel
            assert abs(o.result.bytes_received - rate * own * (n - 1)) <= 0.05 * rate * numel


def test_a_reduce_scatter_needs_a_dense_codec():
    with peer_group(2, codec="topk") as (loop, peers, _):
        with pytest.raises(ExchangeError, match="dense codec"):
            loop.run(peers[0].exchange.areduce_scatter([torch.ones(64)], round_id=1, key="a", columns=2))
