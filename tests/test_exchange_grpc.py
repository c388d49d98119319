"""The gRPC exchange between real TLS servers on loopback (one process, one loop, N servers)."""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import CancelledError

import pytest
import torch
from _net_helpers import (  # noqa: F401 - a fixture
    RUN,
    EntryComesLate,
    close_peers,
    no_lost_task_exceptions,
    peer_group,
    start_peers,
)

from murmur.node.exchange.grpc_exchange import ExchangeSettings, ExchangeSettingsError, spans
from murmur.node.exchange.settings import alignment, chunk_ranges
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.net.server import PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, fetch_state, newest_state, state_name
from murmur.optim.codecs import make_codec
from murmur.optim.exchange import ExchangeError
from murmur.optim.inprocess import InProcessGroup
from murmur.protocol import peer_pb2
from murmur.protocol.identity import BanList, CertificateAuthority
from murmur.protocol.wire import tensors_hash

TIMEOUT = 60  # seconds a test waits for a future: generous, the machine may be busy


def inputs(n: int, shapes=((37, 5), (300,)), seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(n)]


def run_reduce(peers, xs, round_id=1, key="k", weights=None):
    weights = weights or [1.0] * len(peers)
    futs = [
        p.exchange.all_reduce(x, round_id=round_id, key=key, weight=w)
        for p, x, w in zip(peers, xs, weights, strict=True)
    ]
    out = []
    for f in futs:
        try:
            out.append(f.result(timeout=TIMEOUT))
        except (ExchangeError, CancelledError) as err:  # CancelledError: a peer the test killed
            out.append(err)
    return out


def assert_identical(results):
    first = results[0]
    for r in results[1:]:
        for a, b in zip(first.tensors, r.tensors, strict=True):
            assert torch.equal(a, b)


# codec -> the bound on |result - mean| per element, relative to the inputs' max |value|:
# the inputs are quantized once and the owner's aggregate once more.
BOUNDS = {"fp32": 1e-6, "fp16": 2e-3, "int8": 2 * 2 / 127, "int4": 2 * 2 / 7}


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_all_reduce_is_the_mean_within_the_codec_bound(n, codec):
    with peer_group(n, codec=codec) as (_, peers, _):
        xs = inputs(n, seed=n)
        results = run_reduce(peers, xs)
        assert all(not isinstance(r, Exception) for r in results), results
        assert_identical(results)
        scale = max(t.abs().max().item() for x in xs for t in x)
        for i, got in enumerate(results[0].tensors):
            mean = sum(x[i] for x in xs) / n
            assert got.shape == mean.shape
            assert (got - mean).abs().max().item() <= BOUNDS[codec] * scale + 1e-6
        assert results[0].members == sorted(p.node_id for p in peers)
        assert results[0].dropped == {}
        # Bytes: each peer sends about (N-1)/N of its payload plus (N-1)/N of the result.
        if codec == "fp32":
            numel = sum(t.numel() for t in xs[0])
            sent = sum(r.bytes_sent for r in results) / n
            assert sent == pytest.approx(2 * (n - 1) / n * 4 * numel, rel=0.35)


def test_weight_zero_joiner_does_not_move_the_mean():
    with peer_group(3) as (_, peers, _):
        xs = inputs(3)
        results = run_reduce(peers, xs, weights=[1.0, 1.0, 0.0])
        assert_identical(results)
        for i, got in enumerate(results[0].tensors):
            assert torch.allclose(got, (xs[0][i] + xs[1][i]) / 2, atol=1e-6)
        assert len(results[0].members) == 3


def test_all_gather_returns_every_peers_sparse_update():
    n = 4
    with peer_group(n, codec="topk") as (loop, peers, _):
        codec = make_codec("topk")
        wires = [[codec.encode_stateless(torch.randn(4096), "w")] for _ in range(n)]
        futs = [p.exchange.all_gather(w, round_id=3, key="demo") for p, w in zip(peers, wires, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        for res in results:
            assert sorted(res.updates) == sorted(p.node_id for p in peers)
            for p, w in zip(peers, wires, strict=True):
                got = res.updates[p.node_id][0]
                assert got.codec == w[0].codec and got.shape == w[0].shape
                for name, t in w[0].parts.items():
                    assert torch.equal(got.parts[name], t)


def test_sparse_codec_all_reduce_aggregates_every_payload_identically():
    with peer_group(3, codec="topk") as (_, peers, _):
        xs = inputs(3, shapes=((8192,),))
        results = run_reduce(peers, xs)
        assert_identical(results)
        assert len(results[0].members) == 3


@pytest.mark.parametrize("average", ["members", "senders"])
def test_sparse_average_over_members_or_senders_is_the_same_over_grpc_as_in_process(average):
    """A coordinate sent by one of three peers: 1/3 of it over members, all of it over senders;
    the nodes' gRPC path and the simulator's in-process path give the same bits."""
    xs = [[torch.zeros(4096)] for _ in range(3)]
    for i, x in enumerate(xs):
        x[0][i * 100 : i * 100 + 64] = float(i + 1)  # three disjoint top-64 sets
    xs[2][0][:64] = 9.0  # and one coordinate set shared by peers 0 and 2
    with peer_group(3, codec="topk", codec_kw={"sparse_average": average}) as (_, peers, _):
        results = run_reduce(peers, xs, weights=[1.0, 1.0, 2.0])
    assert_identical(results)
    got = results[0].tensors[0]
    group = InProcessGroup([p.node_id for p in peers], lambda: make_codec("topk", sparse_average=average))
    futs = [group.exchange(p.node_id).all_reduce(x, round_id=1, key="k", weight=w)
            for p, x, w in zip(peers, xs, [1.0, 1.0, 2.0], strict=True)]
    assert torch.equal(futs[0].result(timeout=TIMEOUT).tensors[0], got)
    shared, only_peer1 = got[:64], got[100:164]
    if average == "members":
        torch.testing.assert_close(only_peer1, torch.full((64,), 2.0 / 4))
        torch.testing.assert_close(shared, torch.full((64,), (1.0 + 2 * 9.0) / 4))
    else:
        torch.testing.assert_close(only_peer1, torch.full((64,), 2.0))
        torch.testing.assert_close(shared, torch.full((64,), (1.0 + 2 * 9.0) / 3))
    assert got[200:264].abs().sum() == 0  # peer 2's own set was displaced by the shared one


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("nan", "NaN"),
        ("wrong_shape", "shape"),
        ("corrupt", "malformed payload"),
        ("oversize", "over the limit"),
        ("wrong_version", "this node speaks v1, the caller speaks v2"),
    ],
)
def test_bad_input_is_refused_with_its_reason_and_the_honest_round_completes(fault, reason):
    with peer_group(4, codec="int8", max_payload_bytes=1 << 20) as (_, peers, _):
        bad = peers[1]
        bad.faults.arm(fault, peer=bad.node_id, round=1)
        xs = inputs(4)
        results = run_reduce(peers, xs)
        honest = [r for p, r in zip(peers, results, strict=True) if p is not bad]
        assert all(not isinstance(r, Exception) for r in honest), honest
        assert_identical(honest)
        assert bad.node_id not in honest[0].members and len(honest[0].members) == 3
        assert reason in honest[0].dropped[bad.node_id]
        scale = max(t.abs().max().item() for x in xs for t in x)
        for i, got in enumerate(honest[0].tensors):
            mean = sum(x[i] for p, x in zip(peers, xs, strict=True) if p is not bad) / 3
            assert (got - mean).abs().max().item() <= BOUNDS["int8"] * scale
        # The refused peer does not drift: it catches up with the honest result.
        assert not isinstance(results[1], Exception), results[1]
        assert_identical([honest[0], results[1]])


def test_a_peer_that_lost_its_result_catches_up_from_those_that_completed():
    with peer_group(4, codec="int8") as (_, peers, _):
        lagging = peers[2]
        lagging.faults.arm("lose_result", peer=lagging.node_id, round=1)
        results = run_reduce(peers, inputs(4))
        assert all(not isinstance(r, Exception) for r in results), results
        assert_identical(results)
        assert (1, "k") in lagging.exchange.caught_up
        assert len(results[0].members) == 4  # its input still counted: only the reply was lost
        hashes = {p.exchange.book.done[(1, "k")].result_hash for p in peers}
        assert len(hashes) == 1


def test_a_peer_that_lost_a_result_still_owns_its_span_until_every_input_is_in():
    """The lagging peer hears every other owner (one answer lost) before its own span has every
    member's input (one member's stream to it is late, as on an overloaded machine: a delay fault).
    It must keep owning its span until that input is in and its reduced chunks are out, not walk
    away from the attempt: the others complete it with all four inputs, and the lagging peer
    catches up."""
    with peer_group(4, codec="int8") as (_, peers, _):
        lagging, slow = peers[2], peers[0]
        slow.faults.arm(
            "delay", peer=slow.node_id, round=1, point="send_input", seconds=1.5, target=lagging.node_id, times=-1
        )
        lagging.faults.arm("lose_result", peer=lagging.node_id, round=1)
        results = run_reduce(peers, inputs(4))
        assert ("delay", slow.node_id, 1) in slow.faults.fired  # the late stream really was late
        assert all(not isinstance(r, Exception) for r in results), results
        assert_identical(results)
        assert all(len(r.members) == 4 and not r.dropped for r in results[:2] + results[3:]), results
        assert (1, "k") in lagging.exchange.caught_up
        assert not any((1, "k") in p.exchange.caught_up for p in peers if p is not lagging)
        assert len({p.exchange.book.done[(1, "k")].result_hash for p in peers}) == 1


def test_a_stalled_peer_is_dropped_and_its_span_re_owned_within_the_deadline():
    with peer_group(4, codec="fp32", peer_timeout=2.0) as (_, peers, _):
        stalled = peers[3]
        stalled.faults.arm("stall", peer=stalled.node_id, round=1)
        futs = [p.exchange.all_reduce(x, round_id=1, key="k") for p, x in zip(peers, inputs(4), strict=True)]
        honest = [f.result(timeout=TIMEOUT) for f in futs[:3]]
        assert_identical(honest)
        assert stalled.node_id not in honest[0].members
        assert (
            "no answer" in honest[0].dropped[stalled.node_id] or "input" in honest[0].dropped[stalled.node_id]
        )
        futs[3].cancel()


def test_banned_node_is_refused_and_the_others_complete():
    ca = CertificateAuthority.create("t")
    ids = [ca.issue() for _ in range(3)]
    bans = BanList()
    loop = LoopThread()
    peers = []
    try:
        # The banned node keeps its own (empty) ban list, so it tries to take part anyway.
        # round_deadline: the banned node waits this out alone.
        peers = start_peers(loop, ids, ban_lists=[bans, bans, BanList()], round_deadline=15.0)
        bans.ban(ids[2].node_id, "poisoned updates")
        results = run_reduce(peers, inputs(3))
        honest = results[:2]
        assert_identical(honest)
        assert ids[2].node_id not in honest[0].members
        assert any("banned" in why and "poisoned updates" in why for _, why in peers[0].server.refusals)
        assert isinstance(results[2], ExchangeError)  # nobody serves it the result either
    finally:
        close_peers(loop, peers)
        loop.stop()


def test_a_strangers_certificate_fails_the_handshake_and_the_round_completes():
    ca, other_ca = CertificateAuthority.create("run"), CertificateAuthority.create("someone else")
    ids = [ca.issue(), ca.issue(), other_ca.issue()]
    loop = LoopThread()
    peers = []
    try:
        peers = start_peers(loop, ids, peer_timeout=2.0, round_deadline=15.0)
        results = run_reduce(peers, inputs(3))
        assert_identical(results[:2])
        assert ids[2].node_id not in results[0].members
        assert (
            "UNAVAILABLE" in results[0].dropped[ids[2].node_id]
            or "input" in results[0].dropped[ids[2].node_id]
        )
        assert isinstance(results[2], ExchangeError)
    finally:
        close_peers(loop, peers)
        loop.stop()


class Arbiter:
    """The exchange's RoundGate as the coordinator answers it (ClaimRound), for the rounds listed
    in ``refuse``: a split's group. The real one is the node's session, tested with real processes
    (tests/test_churn_restart.py)."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse
        self.claims: list[tuple[int, str, tuple[str, ...]]] = []

    async def claim(self, round_id: int, key: str, members: list[str]) -> None:
        self.claims.append((round_id, key, tuple(members)))
        if round_id in self.refuse:
            raise ExchangeError(f"the coordinator refused this group's round {round_id}: a split")


def test_a_round_the_run_refuses_is_neither_applied_nor_served():
    """A completed call whose group the run's arbiter refuses ends in ExchangeError on every
    member (nothing is applied) and is not served to peers catching up (no ALREADY_DONE, no
    result): a split's result can never spread. The next round, granted, completes as usual."""
    with peer_group(3) as (_, peers, _):
        arbiter = Arbiter(refuse={1})
        for p in peers:
            p.exchange.rounds.catchup.gate = arbiter
        refused = run_reduce(peers, inputs(3), round_id=1)
        assert all(isinstance(r, ExchangeError) and "refused this group's round 1" in str(r) for r in refused)
        assert all(not p.exchange.done_list() for p in peers)
        granted = run_reduce(peers, inputs(3), round_id=2)
        assert all(not isinstance(r, Exception) for r in granted), granted
        assert_identical(granted)
        ids = tuple(sorted(p.node_id for p in peers))
        assert {c for c in arbiter.claims if c[0] == 2} == {(2, "k", ids)}  # every member claimed its group
        assert [d.round for d in peers[0].exchange.done_list()] == [2]


def test_two_peers_need_each_other_no_split_brain():
    with peer_group(2, peer_timeout=0.5, round_deadline=4.0) as (loop, peers, _):
        loop.run(peers[1].server.stop())
        with pytest.raises(ExchangeError, match="quorum|did not complete"):
            peers[0].exchange.all_reduce(inputs(1)[0], round_id=1, key="k").result(timeout=TIMEOUT)


def test_a_peer_restarted_mid_round_under_its_id_completes_the_round_with_the_others():
    """Regression (`murmur testnet chaos`): B is killed mid-round and restarted under the same node id
    at a new address. A met the dead incarnation at the rendezvous, so it lost quorum (1 of 2) and
    used to sit in catch-up until the round deadline, while the new B, meeting A's abandoned
    attempt, gave up on A too: both failed at the deadline. A now meets again (fresh group,
    fresh address) and the round completes among the live peers, well before the deadline."""
    ca = CertificateAuthority.create("test")
    a_id, b_id = ca.issue(), ca.issue()
    loop = LoopThread()
    peers = []
    try:
        a, b_old, b_new = peers = start_peers(loop, [a_id, b_id, b_id], peer_timeout=1.0, round_deadline=30.0)
        a.exchange.group.peers = {a.node_id: a.server.address, b_id.node_id: b_old.server.address}
        loop.run(b_old.server.stop())  # killed after the rendezvous: A still sees its old address
        xs = inputs(2)
        t0 = time.monotonic()
        fut_a = a.exchange.all_reduce(xs[0], round_id=1, key="k")
        time.sleep(1.5)  # A has lost quorum by now
        new_view = {a.node_id: a.server.address, b_id.node_id: b_new.server.address}
        a.exchange.group.peers = dict(new_view)  # the restarted B overwrote its rendezvous entry
        b_new.exchange.group.peers = dict(new_view)
        fut_b = b_new.exchange.all_reduce(xs[1], round_id=1, key="k")
        results = [fut_a.result(timeout=TIMEOUT), fut_b.result(timeout=TIMEOUT)]
        assert time.monotonic() - t0 < 20.0  # not the round deadline
        assert_identical(results)
        assert results[0].members == sorted([a.node_id, b_id.node_id])
        for i, got in enumerate(results[0].tensors):
            assert torch.allclose(got, (xs[0][i] + xs[1][i]) / 2, atol=1e-6)
    finally:
        close_peers(loop, peers)
        loop.stop()


def test_consecutive_rounds_and_keys_are_independent():
    with peer_group(3, codec="int8") as (_, peers, _):
        for r in range(1, 4):
            for key in ("a", "b"):
                results = run_reduce(peers, inputs(3, seed=r), round_id=r, key=key)
                assert_identical(results)
        assert len(peers[0].exchange.book.done) == 6


def test_fetch_state_from_several_peers_verifies_the_hash():
    with peer_group(3) as (loop, peers, _):
        state = [(f"layer{i}.weight", torch.randn(64, 33)) for i in range(5)] + [("step", torch.tensor(7))]
        digest = tensors_hash(state)
        for p in peers[:2]:
            p.server.publish_state(PublishedState(state_name(4), state, digest, []))
        sources = {p.node_id: p.server.address for p in peers[:2]}
        got = fetch_state(sources, 4, digest, identity=peers[2].identity, loop=loop)
        assert list(got) == [n for n, _ in state]
        for name, t in state:
            assert torch.equal(got[name], t)
        with pytest.raises(StateError, match="no peer could serve"):
            fetch_state(sources, 4, b"\0" * 32, identity=peers[2].identity, loop=loop)



def test_a_peer_names_the_newest_state_it_serves():
    """A joiner whose DHT record names a state the holder already dropped asks the holder for the
    newest it serves (NEWEST_STATE): the highest round, not the latest published name (a result is
    published after its round's state), and a peer serving none says so."""
    with peer_group(3) as (loop, peers, _):
        holder, asker = peers[0], peers[2]
        states = {r: [("w", torch.full((3,), float(r))), ("round", torch.tensor(r))] for r in (4, 6, 5)}
        for r, state in states.items():
            holder.server.publish_state(PublishedState(state_name(r), state, tensors_hash(state), []))
        holder.server.publish_state(PublishedState("result/6/k", states[4], tensors_hash(states[4]), []))
        ask = StateFetchSettings(call_timeout=10)
        got = loop.run(newest_state(asker.identity, holder.node_id, holder.server.address, ask))
        assert got == (6, tensors_hash(states[6]))
        fetched = fetch_state({holder.node_id: holder.server.address}, 6, got[1], identity=asker.identity, loop=loop)
        assert torch.equal(fetched["w"], states[6][0][1])
        with pytest.raises(StateError, match="NOT_FOUND"):
            loop.run(newest_state(asker.identity, peers[1].node_id, peers[1].server.address, ask))

def test_hello_reports_completed_rounds():
    with peer_group(2) as (loop, peers, _):
        run_reduce(peers, inputs(2), round_id=9, key="x")
        done = peers[0].exchange.done_list()
        assert [(d.round, d.key) for d in done] == [(9, "x")]
        assert isinstance(done[0], peer_pb2.RoundDone) and RUN


def test_spans_cover_the_update_with_aligned_boundaries():
    for numel in (0, 1, 63, 64, 1000, 4097):
        for n in (1, 2, 3, 8):
            sp = spans(numel, n, 64)
            assert len(sp) == n and sp[0][0] == 0 and sp[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(sp, sp[1:], strict=False))
            assert all(s % 64 == 0 or s == numel for s, _ in sp)


def test_settings_are_validated():
    with pytest.raises(ExchangeSettingsError, match="peer_timeout"):
        ExchangeSettings(peer_timeout=0)
    with pytest.raises(ExchangeSettingsError, match="frame_bytes"):
        ExchangeSettings(frame_bytes=64 << 20)


@pytest.mark.parametrize("codec", ["int4", "fp16"])
def test_more_peers_than_spans_leaves_empty_spans_that_still_complete(codec):
    with peer_group(5, codec=codec) as (_, peers, _):
        xs = inputs(5, shapes=((100,),))
        results = run_reduce(peers, xs)
        assert_identical(results)
        scale = max(x[0].abs().max().item() for x in xs)
        bound = {"int4": BOUNDS["int4"], "fp16": BOUNDS["fp16"]}[codec]
        assert (results[0].tensors[0] - sum(x[0] for x in xs) / 5).abs().max().item() <= bound * scale


# --- the pipeline: spans travel as several chunks -------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_pipelined_all_reduce_over_many_chunks_per_span_is_the_mean(n, codec):
    shapes = ((3000,), (17, 40))
    numel = sum(math.prod(s) for s in shapes)
    with peer_group(n, codec=codec) as (_, peers, _):
        settings = peers[0].exchange.settings
        align = alignment(settings.span_align, peers[0].exchange.codec)
        sp = spans(numel, n, align)
        assert all(len(chunk_ranges(b - a, settings.chunk_elements(align))) >= 5 for a, b in sp)
        xs = inputs(n, shapes=shapes, seed=7)
        chunked = run_reduce(peers, xs)
        assert all(not isinstance(r, Exception) for r in chunked), chunked
        assert_identical(chunked)
        scale = max(t.abs().max().item() for x in xs for t in x)
        for i, got in enumerate(chunked[0].tensors):
            mean = sum(x[i] for x in xs) / n
            assert (got - mean).abs().max().item() <= BOUNDS[codec] * scale + 1e-6
    # Chunk boundaries fall on codec blocks: one chunk per span gives the same result, up to the
    # float rounding of the mean (a vectorized sum may associate differently over another length)
    # and the one quantization step that a last-bit difference can flip.
    with peer_group(n, codec=codec, chunk_mb=1.0) as (_, peers, _):
        whole = run_reduce(peers, xs)
        step = 1e-6 if codec == "fp32" else scale / 127
        for a, b in zip(chunked[0].tensors, whole[0].tensors, strict=True):
            assert (a - b).abs().max().item() <= step


@pytest.mark.parametrize("fault", ["exit_midstream", "exit"])
def test_a_peer_killed_mid_stream_leaves_the_survivors_with_one_state(fault):
    """The victim dies halfway through streaming its chunks (or right after its last one): its server
    and its connections vanish, as on SIGKILL. The survivors re-own its span and agree bit for bit."""
    with peer_group(4, codec="int8", peer_timeout=2.0) as (loop, peers, _):
        victim = peers[3]
        victim.server.settings.stop_grace = 0.0

        def die() -> None:
            asyncio.ensure_future(victim.server.stop())
            asyncio.ensure_future(victim.exchange.aclose())

        victim.faults.die = die
        victim.faults.arm(fault, peer=victim.node_id, round=1)
        xs = inputs(4, shapes=((2000,),), seed=3)
        results = run_reduce(peers, xs)
        # The victim's own call ends with "killed", or cancelled when its closed channels cut it short.
        assert isinstance(results[3], CancelledError) or "killed" in str(results[3])
        survivors = results[:3]
        assert all(not isinstance(r, Exception) for r in survivors), survivors
        assert_identical(survivors)
        hashes = {p.exchange.book.done[(1, "k")].result_hash for p in peers[:3]}
        assert len(hashes) == 1
        members = survivors[0].members
        live = 3
        if fault == "exit" and victim.node_id in members:
            # A race the test cannot exclude, SIGKILL or not: the victim dies after its last input
            # chunk, and its own span may already have answered OK to everyone by then. Every owner
            # then had every input: a complete round of all four, not a partial average.
            assert members == sorted(p.node_id for p in peers)
            live = 4
        else:
            assert members == sorted(p.node_id for p in peers[:3]) and victim.node_id in survivors[0].dropped
        scale = max(x[0].abs().max().item() for x in xs)
        mean = sum(x[0] for x in xs[:live]) / live
        assert (survivors[0].tensors[0] - mean).abs().max().item() <= BOUNDS["int8"] * scale


def test_the_snapshot_is_the_flat_update_plus_residual_and_copies_what_is_asked_first():
    from murmur.node.exchange.grpc_exchange import _flatten
    from murmur.node.exchange.snapshot import Snapshot

    g = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(300, 7, generator=g).t(),  # not contiguous
        torch.randn(1000, generator=g).half(),
        torch.randn(3, 333, generator=g),
    ]
    numel = sum(t.numel() for t in tensors)
    residual = torch.randn(numel, generator=g)
    injector = FaultInjector()  # every piece's copy is slow, so the order shows
    injector.arm("delay", point="snapshot_piece", seconds=0.01, times=-1)

    async def main():
        snap = Snapshot(tensors, residual, 100, injector.call_faults("p", 1))
        snap.start()
        await snap.ready(numel - 50, numel)  # the last piece, asked for at once
        assert not snap.complete.is_set()
        assert torch.equal(snap.flat[numel - 50 :], (_flatten(tensors) + residual)[numel - 50 :])
        return await snap.wait(), snap.order

    flat, order = asyncio.run(main())
    assert torch.equal(flat, _flatten(tensors) + residual)
    pieces = math.ceil(numel / 100)
    assert sorted(order) == list(range(pieces)) and order.index(pieces - 1) <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_update_is_copied_after_the_work_that_made_it_and_not_after_the_steps_queued_since():
    """The pieces of an update on a GPU are queued at once on a side stream: the snapshot is the
    update the queued work made, and it completes while steps queued after it still run (a wait
    per piece waited for those steps each time)."""
    from murmur.node.exchange.grpc_exchange import _flatten
    from murmur.node.exchange.snapshot import Snapshot

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    a = torch.randn(2048, 2048, device=dev, generator=g)
    tensors = [(a @ a)[:, :700].t(), torch.randn(1000, device=dev, generator=g).half(), a[:3, :333] * 2]
    numel = sum(t.numel() for t in tensors)
    residual = torch.randn(numel)
    expected = _flatten(tensors) + residual
    busy = torch.randn(8192, 8192, device=dev)

    async def main():
        snap = Snapshot(tensors, residual, 1000, None)
        snap.start()
        later = busy
        for _ in range(60):  # the next inner steps, queued on the training stream: about a second
            later = later @ busy / 8192
        queued = torch.cuda.Event()
        queued.record()
        flat = await snap.wait()
        return flat, queued.query()

    flat, later_done = asyncio.run(main())
    assert torch.equal(flat, expected) and flat.is_pinned()
    assert not later_done, "the snapshot waited for the work queued after it"
    torch.cuda.synchronize()


def test_chunk_that_cannot_fit_one_frame_is_refused():
    with pytest.raises(ExchangeSettingsError, match="chunk_mb"):
        ExchangeSettings(chunk_mb=9.0)
    assert ExchangeSettings(chunk_mb=1.0, span_align=4096).chunk_elements(4096) == 61 * 4096
    assert chunk_ranges(0, 64) == [(0, 0)] and chunk_ranges(130, 64) == [(0, 64), (64, 128), (128, 130)]


def _die_in_process(victim) -> None:
    """The exit faults' stand-in for SIGKILL when peers share one process: the victim's server and
    connections vanish at once."""
    victim.server.settings.stop_grace = 0.0

    def die() -> None:
        asyncio.ensure_future(victim.server.stop())
        asyncio.ensure_future(victim.exchange.aclose())

    victim.faults.die = die


def test_a_peer_that_aborts_mid_stream_leaves_no_task_exception_unretrieved():
    """Regression (node logs full of "Task exception was never retrieved" from collect.py): the
    victim's first chunk is garbage and it dies right after sending it, so each owner's decode of
    that chunk fails while its stream is being torn down. The survivors complete without it, and
    no task is left holding an exception nobody looked at (the autouse fixture checks)."""
    with peer_group(3, codec="int8", peer_timeout=2.0) as (_, peers, _):
        victim = peers[2]
        _die_in_process(victim)
        victim.faults.arm("corrupt", peer=victim.node_id, round=1)
        victim.faults.arm("exit_midstream", peer=victim.node_id, round=1)  # after its first chunk
        results = run_reduce(peers, inputs(3, shapes=((400,),), seed=4))
        survivors = results[:2]
        assert all(not isinstance(r, Exception) for r in survivors), survivors
        assert_identical(survivors)
        assert victim.node_id not in survivors[0].members and victim.node_id in survivors[0].dropped


def test_a_peer_the_others_did_not_meet_catches_up_and_does_not_stop_them():
    """Regression (chaos test, round 1): three peers met at the rendezvous without the fourth, which
    met all four. The fourth is no member of their attempts: being left out must neither end its
    call (it adopts their result) nor abort their attempts."""
    with peer_group(4, peer_timeout=2.0, round_deadline=30.0) as (_, peers, _):
        three = {p.node_id: p.server.address for p in peers[:3]}
        for p in peers[:3]:
            p.exchange.group.peers = dict(three)
        xs = inputs(4)
        t0 = time.monotonic()
        results = run_reduce(peers, xs)
        assert all(not isinstance(r, Exception) for r in results), results
        assert time.monotonic() - t0 < 20.0  # not the round deadline
        assert_identical(results)
        assert results[0].members == sorted(three)
        for i, got in enumerate(results[0].tensors):
            assert torch.allclose(got, sum(x[i] for x in xs[:3]) / 3, atol=1e-6)


def test_a_peer_later_than_the_served_results_fails_at_once_instead_of_polling_to_the_deadline():
    """Regression (chaos round read by hand, issue 14): a restarted node came to round r when its
    peers had completed r + keep_results. They list r among their completed calls, but serve only
    their last keep_results results, so it polled for a result nobody served until the round
    deadline (and every other node's rendezvous waited for it). It must fail at once, saying why,
    so the daemon re-syncs to the newest state."""
    with peer_group(3, round_deadline=60.0, keep_results=2) as (_, peers, _):
        two, late = peers[:2], peers[2]
        for p in two:
            p.exchange.group.peers = {q.node_id: q.server.address for q in two}
        for r in (1, 2, 3):
            assert all(not isinstance(x, Exception) for x in run_reduce(two, inputs(2, seed=r), round_id=r))
        assert all((1, "k") in p.exchange.book.done for p in two)  # still listed as completed
        t0 = time.monotonic()
        with pytest.raises(ExchangeError, match="no longer serve its result"):
            late.exchange.all_reduce(inputs(1)[0], round_id=1, key="k").result(timeout=TIMEOUT)
        assert time.monotonic() - t0 < 20.0  # not the 60 s round deadline
        # A round the peers still serve is caught up as before.
        got = late.exchange.all_reduce(inputs(1)[0], round_id=3, key="k").result(timeout=TIMEOUT)
        assert (3, "k") in late.exchange.caught_up
        assert got.members == sorted(p.node_id for p in two)


def test_member_lists_that_differ_converge_on_the_peers_someone_met():
    """Regression (chaos test, round 1): two peers met three, two met all four. The owners' answers
    name the fourth to the first two, who look again, learn its address and take it in: the lists
    converge within a few attempts, not after a lost quorum or the round deadline."""
    with peer_group(4, peer_timeout=2.0, round_deadline=30.0) as (_, peers, _):
        every = {p.node_id: p.server.address for p in peers}
        for p in peers[:2]:
            p.exchange.rounds.group = EntryComesLate(dict(list(every.items())[:3]), every)
        t0 = time.monotonic()
        results = run_reduce(peers, inputs(4))
        assert all(not isinstance(r, Exception) for r in results), results
        assert time.monotonic() - t0 < 10.0  # not the round deadline
        assert_identical(results)
        assert results[0].members == sorted(p.node_id for p in peers)


class _SeesOnlyItself:
    """A rendezvous that shows this peer alone, while the DHT lists ``announced`` trainers and
    the coordinator's view is not whole yet (no quorum base from it)."""

    def __init__(self, me: dict[str, str], announced: int) -> None:
        self.me, self.n = me, announced

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        return dict(self.me)

    def quorum_base(self) -> None:
        return None

    def announced(self) -> int:
        return self.n


def test_a_peer_alone_at_the_rendezvous_does_not_complete_while_the_dht_lists_others():
    """Regression (test_poisoning under load, round 2): before the coordinator's view was whole,
    the first peer at a rendezvous saw only itself, completed the round alone, and the three
    others adopted that one-member result. The trainers the DHT lists count for the quorum."""
    with peer_group(1, round_deadline=3.0) as (_, peers, _):
        p = peers[0]
        p.exchange.rounds.group = _SeesOnlyItself({p.node_id: p.server.address}, announced=4)
        with pytest.raises(ExchangeError, match="no quorum"):
            p.exchange.all_reduce([torch.ones(100)], round_id=2, key="k").result(timeout=30)
        p.exchange.rounds.group = _SeesOnlyItself({p.node_id: p.server.address}, announced=1)
        assert p.exchange.all_reduce([torch.ones(100)], round_id=3, key="k").result(timeout=30).members == [p.node_id]


class _StartWaitedForTwo(EntryComesLate):
    """P's group: its start counted two peers (node/exchange/start_floor.py), and its first look
    at the rendezvous shows it alone."""

    def fewest(self) -> int:
        return 2


def test_a_peer_whose_start_waited_for_two_does_not_complete_its_first_round_alone():
    """Regression (test_churn_restart under CI load): a node started with --min-peers 2 counted a
    peer that was still loading, met nobody at its first rendezvous, and trained rounds alone. The
    floor keeps its attempt from starting with one: it meets again, and both complete together."""
    with peer_group(2, round_deadline=30.0) as (_, peers, _):
        every = {p.node_id: p.server.address for p in peers}
        p = peers[0]
        p.exchange.rounds.group = _StartWaitedForTwo({p.node_id: p.server.address}, every)
        results = run_reduce(peers, inputs(2))
        assert all(not isinstance(r, Exception) for r in results), results
        assert [r.members for r in results] == [sorted(every)] * 2
    with peer_group(1, round_deadline=3.0) as (_, peers, _):
        p = peers[0]
        p.exchange.rounds.group = _StartWaitedForTwo({p.node_id: p.server.address}, {p.node_id: p.server.address})
        with pytest.raises(ExchangeError, match="start waited for"):
            p.exchange.all_reduce([torch.ones(100)], round_id=2, key="k").result(timeout=30)


def test_a_caller_at_a_later_attempt_ends_the_owners_current_one_at_once():
    """Two peers one attempt apart used to wait out each other's peer_timeout in every attempt
    and step on together, one apart again, until the round's deadline (a poisoning run under
    load). A caller that comes with a later attempt ends the owner's current one at once, and the
    owner's next attempt is the caller's number."""
    from murmur.node.exchange.attempt import Attempt, RoundBook

    class Pending(Attempt):
        def complete(self, member: str) -> bool:
            return False

    async def scenario() -> None:
        book = RoundBook()
        rk = (5, "k")
        att = Pending(op=0, round_id=5, key="k", number=2, members=("a", "b"), layout=b"")
        await book.register(att)
        book.saw_attempt(rk, 2, "b")  # the same attempt: nothing changes
        book.saw_attempt(rk, 1, "b")  # an older one: nothing changes
        assert not att.done.is_set() and rk not in book.ahead
        book.saw_attempt(rk, 3, "b")
        assert att.done.is_set() and "b is at attempt 3" in att.failed["*"]
        assert book.ahead[rk] == 3
        book.forget(*rk)
        assert rk not in book.ahead

    asyncio.run(scenario())


def test_a_peer_server_on_a_port_another_process_holds_fails_with_a_clear_line():
    """Without gRPC's default SO_REUSEPORT: binding a port a stranger's server holds fails, and says
    so, instead of sharing the port (and the peers' calls) with it."""
    from concurrent import futures

    import grpc

    from murmur.node.net.server import PeerServer, PeerServerSettings
    from murmur.protocol.identity import IdentityError

    stranger = grpc.server(futures.ThreadPoolExecutor(1))
    port = stranger.add_insecure_port("127.0.0.1:0")
    stranger.start()
    server = PeerServer(CertificateAuthority.create("t").issue(), run_id="r", settings=PeerServerSettings(port=port))
    try:
        with pytest.raises(IdentityError, match=rf"could not bind the peer server to 127\.0\.0\.1:{port}: is the port"):
            asyncio.run(server.start())
    finally:
        stranger.stop(0)
