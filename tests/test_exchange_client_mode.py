"""Client mode in the exchange: a peer nobody can dial owns no span, streams its input to the
owners and reads the reduced spans back on its own calls; for a gather it fetches the result from
an owner. The client peers here have their servers stopped, so any dial towards them would fail."""

from __future__ import annotations

import time

import pytest
import torch
from _net_helpers import EntryComesLate, no_lost_task_exceptions, peer_group  # noqa: F401 - a fixture

from murmur.optim.codecs import make_codec
from murmur.optim.exchange import ExchangeError
from murmur.protocol.reachability import CLIENT_ADDRESS

TIMEOUT = 60.0


def _inputs(n: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


@pytest.mark.parametrize("clients", [1, 2])
def test_client_mode_peers_take_part_in_a_reduce_and_hold_the_same_result(clients):
    with peer_group(4, codec="fp32", clients=clients) as (_, peers, _):
        assert [p.server.address == CLIENT_ADDRESS for p in peers] == [False] * (4 - clients) + [True] * clients
        xs = _inputs(4)
        futs = [p.exchange.all_reduce([x], round_id=1, key="k") for p, x in zip(peers, xs, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        want = torch.stack(xs).mean(0)
        for r in results:
            assert sorted(r.members) == sorted(p.node_id for p in peers) and not r.dropped
            assert torch.equal(r.tensors[0], results[0].tensors[0])  # bit-identical on every member
        torch.testing.assert_close(results[0].tensors[0], want, rtol=1e-5, atol=1e-6)
        # A client sent its whole input (fp32: 4 bytes an element) to the owners and received the
        # whole result from them, as a member that owns a span does for the other spans.
        for r in results[4 - clients :]:
            assert r.bytes_sent >= 4 * 1000 and r.bytes_received >= 4 * 1000, r


def test_a_client_mode_peer_takes_a_gathers_payloads_from_an_owner():
    with peer_group(3, codec="topk", clients=1) as (_, peers, _):
        codec = make_codec("topk")
        wires = [[codec.encode_stateless(x, "w")] for x in _inputs(3, 4096, seed=1)]
        futs = [p.exchange.all_gather(w, round_id=2, key="demo") for p, w in zip(peers, wires, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        for res in results:
            assert set(res.updates) == {p.node_id for p in peers}
            for p, w in zip(peers, wires, strict=True):
                assert torch.equal(res.updates[p.node_id][0].parts["values"], w[0].parts["values"])


def test_a_round_of_client_mode_peers_only_fails_saying_someone_must_own_the_spans():
    with peer_group(2, codec="fp32", clients=2, round_deadline=2.0) as (_, peers, _):
        futs = [p.exchange.all_reduce([x], round_id=1, key="k") for p, x in zip(peers, _inputs(2), strict=True)]
        for f in futs:
            with pytest.raises(ExchangeError, match="client mode"):
                f.result(timeout=TIMEOUT)


def test_an_owner_whose_only_other_member_is_a_client_learns_of_a_peer_it_missed():
    """Regression (the NAT test under load, round 1): owner A met only itself and the client, so
    it calls nobody and no owner's answer could name the reachable peer it missed. The client's
    header lists that peer (and the peer calls A): A looks again and takes it in, instead of
    failing attempt after attempt on the client's disagreement until the round deadline."""
    with peer_group(3, codec="fp32", clients=1, peer_timeout=2.0, round_deadline=30.0) as (_, peers, _):
        every = {p.node_id: p.server.address for p in peers}
        a, missed, client = peers
        a.exchange.rounds.group = EntryComesLate({k: v for k, v in every.items() if k != missed.node_id}, every)
        t0 = time.monotonic()
        xs = _inputs(3)
        futs = [p.exchange.all_reduce([x], round_id=1, key="k") for p, x in zip(peers, xs, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        assert time.monotonic() - t0 < 10.0  # not the round deadline
        assert all(sorted(r.members) == sorted(every) for r in results), [r.members for r in results]
        assert all(torch.equal(r.tensors[0], results[0].tensors[0]) for r in results)
