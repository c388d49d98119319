"""Poisoned updates, end to end: the production fault injector armed with `murmur node run --fault`,
the robust aggregators that bound them, the owners that record who sent a refused update, and the
coordinator that counts them per node (`murmur admin nodes show`; a ban stays the operator's call).

The exchange-level tests run real peers (gRPC, TLS) in one process; the end-to-end ones run a
coordinator and four `murmur node run` processes, one of them poisoning every round."""

from __future__ import annotations

import re

import pytest
import torch
from _net_helpers import RUN, no_lost_task_exceptions  # noqa: F401 - a fixture
from _node_helpers import log, make_testnet, small_dataset, trained

from murmur.coordinator.store import Store
from murmur.node.exchange.group import StaticGroup
from murmur.node.exchange.peer import PeerSpec, build_peer
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import make_codec
from murmur.optim.exchange import ExchangeError
from murmur.protocol.identity import CertificateAuthority

TIMEOUT = 60.0


# -- the owners record who sent a refused update ---------------------------------------------------


def _robust_peers(loop: LoopThread, n: int, rule: str):
    ca = CertificateAuthority.create("test")
    built = []
    try:
        for _ in range(n):
            spec = PeerSpec(
                identity=ca.issue(),
                run_id=RUN,
                codec=make_codec("int8"),
                group=StaticGroup({}),
                aggregator=Aggregator(rule=rule),  # the pre-filter on, as a run's aggregator has it
                settings=ExchangeSettings(peer_timeout=5.0, round_deadline=30.0),
                faults=FaultInjector(),
            )
            built.append(build_peer(spec, loop))
    except BaseException:
        _close(loop, built)
        raise
    view = {p.node_id: p.address for p in built}
    for p in built:
        p.exchange.group.peers = dict(view)
    return built


@pytest.mark.parametrize(
    "kind, why",
    [
        ("poison_scale", "norm"),
        ("poison_nan", "NaN|finite"),
        # declared past max_payload_bytes: refused before a byte is read, and recorded with the sizes
        ("oversize", r"^oversized update: \d+ bytes declared, over the limit of \d+$"),
    ],
)
def test_the_owners_record_who_sent_a_refused_update(kind, why):
    loop = LoopThread()
    peers = []
    try:
        peers = _robust_peers(loop, 4, "trimmed_mean")
        bad = peers[3]
        bad.exchange.faults.arm(kind, peer=bad.node_id, round=1)
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(4000, generator=g) for _ in peers]
        futs = [p.exchange.all_reduce([x], round_id=1, key="k") for p, x in zip(peers, xs, strict=True)]
        results = []
        for f in futs:
            try:
                results.append(f.result(timeout=TIMEOUT))
            except ExchangeError as err:
                results.append(err)
        honest = results[:3]
        assert all(not isinstance(r, Exception) for r in honest), honest
        assert all(bad.node_id not in r.members for r in honest)
        reports = [r for p in peers for r in loop.run(_take(p))]
        # Whichever owners reduced their span with the poisoned part in refused it and say who sent
        # it (the first refusal ends the attempt for everyone, so at least one does); nobody names
        # an honest member.
        assert reports, "no owner recorded the refused update"
        assert {(r.round, r.sender) for r in reports} == {(1, bad.node_id)}, reports
        assert all(re.search(why, r.reason) for r in reports), reports
        # Taken means gone: the next call starts empty.
        assert loop.run(_take(peers[0])) == []
    finally:
        _close(loop, peers)
        loop.stop()


def _close(loop: LoopThread, peers) -> None:
    for p in peers:
        loop.run(p.aclose())


async def _take(peer):
    return peer.exchange.take_rejections()


def test_the_store_counts_rounds_with_a_refused_update_per_sender(tmp_path):
    store = Store(tmp_path / "c.db")
    try:
        with store.write():
            store.insert_run("r1", "r1", "", "{}", [], 0.0)
            for node in ("a", "b", "c"):
                store.upsert_node(node, "r1", "", "{}", "", 0.0)
        with store.write():
            # Three owners refuse a's update of round 4, one refuses it in round 5; a sender that
            # is not a member of the run is not counted.
            n = store.record_rejections("r1", "b", [("a", 4, "norm 1e4"), ("a", 5, "not finite"), ("zz", 4, "x")])
            n += store.record_rejections("r1", "c", [("a", 4, "norm 1e4")])
        assert n == 3
        assert store.updates_rejected("a") == 2
        assert store.updates_rejected("b") == 0
        assert store.counter("updates_rejected") == 3
        events = store.events(kind="update_rejected")
        assert {(e["node_id"]) for e in events} == {"a"}
    finally:
        store.close()


# -- end to end: four node processes, one poisoning every round -------------------------------------

ROUNDS = 8
# Several 4-node runs: slow, and the first one also runs the clean reference (a module fixture).
e2e = pytest.mark.integration
e2e_timeout = pytest.mark.timeout(900)
# What makes the final loss a measure of the aggregator and not of the run's luck: with the testnet's
# Nesterov 0.9 outer step over 8 rounds the validation loss swings by 3-4% from round to round (the
# same clean run: 3.40, 3.54, 3.47, 3.40, ...), so where round 8 lands on the swing decided the
# check; plain averaging does not swing. And 16 validation batches instead of 4.
STEADY = ["sync.outer_lr=1.0", "sync.outer_momentum=0.0", "train.eval_batches=16"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "10", "--round-timeout", "60", "--dht-record-ttl", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("poison-data"))


def _run(tmp_path, data, aggregator: str, fault: str | None):
    """Four nodes train ROUNDS rounds; node 3 poisons every round with ``fault``. Returns (the
    honest nodes' final validation losses, the admin view of each node by index)."""
    overrides = [f'sync.aggregator="{aggregator}"', f"train.steps={ROUNDS * 5}", "train.eval_every=5", *STEADY]
    net = make_testnet(tmp_path, data, overrides=overrides, node_args=[*FAST_NODE, "--min-peers", "4"])
    net.coordinator_args = ["--dht"]  # the bootstrap peer: no node waits for another's DHT
    with net:
        net.start_coordinator()
        net.create_run(token_uses=8)
        for i in range(4):
            net.add_node(extra=["--fault", f"{fault}@x*"] if fault and i == 3 else None)
        honest = net.nodes[:3]
        for node in honest:  # they stop at the schedule's end
            assert node.proc.wait(300) == 0, log(node)[-3000:]
        poisoner = net.nodes[3]
        net.stop_node(poisoner)  # alone now, it could only wait for a quorum
        losses = []
        for node in honest:
            vals = [r["val_loss"] for r in trained(node) if r.get("val_loss") is not None]
            assert vals, log(node)[-2000:]
            losses.append(vals[-1])
        views = {}
        for node in net.nodes:
            rounds = trained(node)
            if rounds:
                views[node.index] = net.admin("nodes", "show", rounds[-1]["node"])
                views[node.index]["sent_by_the_node"] = rounds[-1]["bytes_sent"]  # its running counter
        return losses, views


@pytest.fixture(scope="module")
def clean(tmp_path_factory, data):
    losses, views = _run(tmp_path_factory.mktemp("clean"), data, "mean", None)
    return sum(losses) / len(losses), views


@e2e
@e2e_timeout
def test_commits_carry_the_bytes_of_their_span_so_the_ledger_sums_to_what_nodes_sent(clean):
    """The coordinator sums the commits' bytes: each carries what its node sent since the last one,
    so a node's total is its last round's running counter, not the sum of the counters."""
    _, views = clean
    assert len(views) == 4
    for view in views.values():
        # The ledger holds what the node's own counter says it sent, less the bytes of any commit
        # the coordinator refused (summing running totals counted it several times over).
        sent = int(view["sent_by_the_node"])
        assert 0 < int(view.get("bytes_sent", 0)) <= sent, view


@e2e
@e2e_timeout
@pytest.mark.parametrize(
    "fault, aggregator",
    [
        ("poison_scale", "trimmed_mean"),
        ("poison_nan", "centered_clip"),
        ("poison_sign", "trimmed_mean"),
        ("poison_random", "centered_clip"),
    ],
)
def test_a_robust_aggregator_keeps_the_honest_loss_within_2_percent(tmp_path, data, clean, fault, aggregator):
    """No more than 2% above the clean plain-mean run. Measured with the STEADY settings on this
    2-core machine with both cores kept busy by two other processes, three runs of each: clean
    3.320-3.322; trimmed_mean against sign flips 3.3285-3.3291 and CenteredClip against noise
    3.319-3.328 (+0.2% at most); x1e4 and NaN 3.315 and 3.317 (refused outright). Ending lower is
    no damage (the robust rules alone end at 3.318)."""
    reference, _ = clean
    losses, views = _run(tmp_path, data, aggregator, fault)
    for loss in losses:
        assert loss <= reference * 1.02, (fault, aggregator, losses, reference)
    if fault in ("poison_scale", "poison_nan"):  # refused outright: the owners name the sender
        assert int(views[3].get("updates_rejected", 0)) >= ROUNDS // 2, views[3]
        assert all(int(views[i].get("updates_rejected", 0)) == 0 for i in range(3)), views


@e2e
@e2e_timeout
def test_with_the_plain_mean_a_flipped_update_under_the_norm_filter_shows_the_damage(tmp_path, data, clean):
    """The attacker who knows the pre-filter flips its update and scales it 8x (the filter drops
    10x the median): the plain mean then steps against the honest direction (9.78 against 3.32,
    measured as above; a plain flip, which halves the step of four nodes, ended at 3.51: +5.7%)."""
    reference, _ = clean
    losses, _ = _run(tmp_path, data, "mean", "poison_flip")
    assert all(not loss <= reference * 1.05 for loss in losses), (losses, reference)  # NaN is damage too



@e2e
@pytest.mark.timeout(600)
def test_an_oversized_update_is_refused_logged_once_and_counted_on_the_coordinator(tmp_path, data):
    """Node 2 declares every update past the receivers' limit (the ``oversize`` fault): each owner
    refuses it, the node logs one line naming the sender and both sizes (once per round and owner),
    and the coordinator counts it against the sender, as a NaN update is. It was dropped in silence:
    left out of every round, no line, no count."""
    rounds = 3
    overrides = [f"train.steps={rounds * 5}", "train.eval_every=5", *STEADY]
    net = make_testnet(tmp_path, data, overrides=overrides, node_args=[*FAST_NODE, "--min-peers", "3"])
    net.coordinator_args = ["--dht"]
    with net:
        net.start_coordinator()
        net.create_run(token_uses=3)
        for i in range(3):
            net.add_node(extra=["--fault", "oversize@x*"] if i == 2 else None)
        honest, bad = net.nodes[:2], net.nodes[2]
        line = (r"refused the update of (\S+) in round (\d+): "
                r"oversized update: (\d+) bytes declared, over the limit of (\d+)")
        for node in honest:  # they stop at the schedule's end
            assert node.proc.wait(300) == 0, log(node)[-3000:]
        net.stop_node(bad)
        m = re.search(line, log(honest[0]))
        assert m, log(honest[0])[-3000:]
        sender = m.group(1)
        assert int(m.group(3)) == int(m.group(4)) + 1  # the fault declares the limit + 1
        assert sender in log(bad)
        for node in honest:
            refusals = [(g[0], g[1]) for g in re.findall(line, log(node))]
            assert refusals and {who for who, _ in refusals} == {sender}, refusals
            assert len(refusals) == len(set(refusals)), refusals  # one line a round
        view = net.admin("nodes", "show", sender)
        assert int(view.get("updates_rejected", 0)) >= 1, view
        for node in honest:
            other = net.admin("nodes", "show", trained(node)[-1]["node"])
            assert int(other.get("updates_rejected", 0)) == 0, other
