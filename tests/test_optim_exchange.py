"""The in-process exchange: results, weights, byte counts as the byte model says, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import make_codec
from murmur.optim.exchange import ExchangeError
from murmur.optim.inprocess import InProcessGroup
from murmur.optim.reduce import allreduce_bytes


def group(k, codec="fp32", rule="mean"):
    return InProcessGroup([f"p{i}" for i in range(k)], lambda: make_codec(codec), Aggregator(rule=rule))


def test_all_reduce_weighted_mean_and_ring_bytes():
    g = group(4)
    futs = [
        g.exchange(f"p{i}").all_reduce([torch.full((10,), float(i))], round_id=0, key="x", weight=w)
        for i, w in enumerate([1.0, 1.0, 1.0, 0.0])  # p3 is a late joiner: weight 0
    ]
    results = [f.result(timeout=5) for f in futs]
    for r in results:
        torch.testing.assert_close(r.tensors[0], torch.full((10,), 1.0))
        assert r.bytes_sent == r.bytes_received == 2 * 3 * 40 // 4  # ring: 2 (K-1)/K * payload
        assert r.codec == "fp32" and r.members == ["p0", "p1", "p2", "p3"]
    assert results[0].tensors[0] is not results[1].tensors[0]  # each member owns its copy


def test_sparse_codec_travels_as_an_all_gather():
    g = group(3, codec="topk")
    x = torch.randn(4096)
    futs = [g.exchange(f"p{i}").all_reduce([x], round_id=0, key="x") for i in range(3)]
    r = futs[0].result(timeout=5)
    own = make_codec("topk").encode(x, "x/0").nbytes
    assert r.bytes_sent == 2 * own and r.bytes_received == 2 * own
    assert allreduce_bytes(False, 3, own, 0) == 2 * own


def test_all_gather_returns_every_members_payload():
    g = group(3)
    codec = make_codec("int8")
    wires = {f"p{i}": [codec.encode_stateless(torch.full((64,), float(i)))] for i in range(3)}
    futs = {p: g.exchange(p).all_gather(w, round_id=5, key="g") for p, w in wires.items()}
    r = futs["p1"].result(timeout=5)
    assert sorted(r.updates) == ["p0", "p1", "p2"]
    assert r.bytes_sent == 2 * wires["p1"][0].nbytes and r.codec == "int8"


def test_threads_meet_and_the_result_is_identical_everywhere():
    g = group(4, codec="int4")
    out = {}

    def work(i):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(i))
        out[i] = g.exchange(f"p{i}").all_reduce([x], round_id=1, key="t").result(timeout=10).tensors[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(out[0], out[i]) for i in range(1, 4))


def test_abort_fails_waiting_and_later_calls():
    g = group(2)
    fut = g.exchange("p0").all_reduce([torch.ones(3)], round_id=0)
    g.abort("p1 crashed")
    with pytest.raises(ExchangeError, match="p1 crashed"):
        fut.result(timeout=5)
    with pytest.raises(ExchangeError):
        g.exchange("p1").all_reduce([torch.ones(3)], round_id=0).result(timeout=5)


def test_a_round_that_cannot_aggregate_fails_for_everyone():
    g = group(2)
    futs = [g.exchange(f"p{i}").all_reduce([torch.full((3,), float("nan"))], round_id=0) for i in range(2)]
    for f in futs:
        with pytest.raises(ExchangeError, match="rejected"):
            f.result(timeout=5)


def test_submitting_twice_is_refused():
    g = group(2)
    g.exchange("p0").all_reduce([torch.ones(3)], round_id=0)
    with pytest.raises(ExchangeError, match="twice"):
        g.exchange("p0").all_reduce([torch.ones(3)], round_id=0).result(timeout=5)
