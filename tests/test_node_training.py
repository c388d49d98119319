"""The node's training side in one process: windows over leased shards, the replicated state's
hash, and the shared state a joiner takes (flattened to named tensors and back)."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future

import pytest
import torch
from _node_helpers import TINY, small_dataset

from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.state_dir import StateDir
from murmur.node.daemon.training import NodeTrainer
from murmur.node.daemon.training_thread import prepare
from murmur.node.daemon.window_types import LeaseView
from murmur.node.model.data import Dataset
from murmur.node.net.faults import FaultInjector
from murmur.optim.exchange import Exchange
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.optim.inprocess import InProcessGroup
from murmur.protocol.fork_guard import FORK_GUARD
from murmur.protocol.runconfig import load_config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return Dataset.open(small_dataset(tmp_path_factory.mktemp("train-data")))


def _cfg(dataset, algorithm="streaming"):
    return load_config(TINY, [f'data.path="{dataset.root}"', f'sync.algorithm="{algorithm}"'])


def _trainers(cfg, dataset, k):
    torch.set_num_threads(1)
    peers = [f"p{i}" for i in range(k)]
    group = InProcessGroup(peers, lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))
    return [
        NodeTrainer(cfg, dataset, torch.device("cpu"), group.exchange(p), round_timeout_s=60) for p in peers
    ]


def _leases(shards):
    """Leases of whole shards, one after another, as the coordinator would grant them."""
    queue = list(shards)
    committed = []

    def next_lease(done):
        if done is not None:
            committed.append(done)
        if not queue:
            return None
        shard, size = queue.pop(0)
        return LeaseView(f"lease-{shard}", shard, 0, size)

    return next_lease, committed


@pytest.mark.parametrize("algorithm", ["diloco", "streaming", "demo"])
def test_replicas_agree_after_every_window(dataset, algorithm):
    cfg = _cfg(dataset, algorithm)
    trainers = _trainers(cfg, dataset, 2)
    sources = [_leases([(s, dataset.shard_size(s)) for s in range(i, 20, 2)])[0] for i in range(2)]
    hashes: list[list[str]] = [[], []]

    def run(i):
        for _ in range(3):
            result = trainers[i].run_window(sources[i], lambda: False)
            assert not result.stopped and result.steps == cfg.sync.inner_steps
            hashes[i].append(trainers[i].global_hash())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(hashes[0]) == 3 and hashes[0] == hashes[1]
    assert len(set(hashes[0])) == 3  # the state moves every round


def test_a_shard_that_runs_out_mid_window_is_committed_with_the_window_whole(dataset):
    cfg = _cfg(dataset, "diloco")
    (trainer,) = _trainers(cfg, dataset, 1)
    span = trainer.span
    # A lease starting 2.5 batches before the shard's end: it runs out within the first window.
    size = dataset.shard_size(0)
    start = size - 2 * span - span // 2
    queue = [LeaseView("a", 0, start, size), LeaseView("b", 1, 0, dataset.shard_size(1))]
    handed = []

    def next_lease(done):
        if done is not None:
            handed.append(done)
        return queue.pop(0) if queue else None

    result = trainer.run_window(next_lease, lambda: False)
    # The next lease is asked for as it runs out (the node names it exhausted), but its span is
    # the window's, committed with the round: counted only if the round completes.
    assert [(s.lease.lease_id, s.start, s.end, s.exhausted) for s in handed] == [("a", start, size, True)]
    rest = (cfg.sync.inner_steps - 2) * span
    got = [(s.lease.lease_id, s.start, s.end, s.exhausted) for s in result.segments]
    assert got == [("a", start, size, True), ("b", 0, rest, False)]
    assert result.tokens == (size - start) + rest


class HeldExchange(Exchange):
    """One member's exchange whose all-reduce results are held back until ``release``: its round
    stays in flight while the test lets the member fill."""

    def __init__(self, inner: Exchange) -> None:
        self.inner, self.held = inner, []

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def all_reduce(self, tensors, *, round_id, key="", weight=1.0):
        out = Future()
        self.held.append((self.inner.all_reduce(tensors, round_id=round_id, key=key, weight=weight), out))
        return out

    def all_gather(self, wire, *, round_id, key=""):
        raise NotImplementedError

    def release(self) -> None:
        held, self.held = self.held, []
        for inner, out in held:
            out.set_result(inner.result(30))


def test_a_fill_that_runs_its_shard_out_leases_the_next_and_commits_both_with_the_next_round(dataset):
    # sync.fill_wait: the window's round is held in flight for 8 fill steps; the lease runs out
    # one step into the fill. The fill closes it in the carry, names it exhausted in the next
    # lease request (with a give-up test: the round landing), and trains on the next shard.
    cfg = load_config(TINY, [f'data.path="{dataset.root}"', 'sync.algorithm="diloco"',
                             'sync.round_budget="speed"', "sync.inner_steps=10"])
    group = InProcessGroup(["p0"], lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))
    exchange = HeldExchange(group.exchange("p0"))
    torch.set_num_threads(1)
    trainer = NodeTrainer(cfg, dataset, torch.device("cpu"), exchange, round_timeout_s=60)
    assert trainer.fills()
    span, size = trainer.span, dataset.shard_size(0)
    start = size - 11 * span - span // 2  # 11 full batches, then a tail of half a batch
    queue = [LeaseView("a", 0, start, size), LeaseView("b", 1, 0, dataset.shard_size(1))]
    asked: list[tuple] = []

    def next_lease(done, give_up=None):
        asked.append((done and (done.lease.lease_id, done.start, done.end, done.exhausted), give_up is not None))
        return queue.pop(0) if queue else None

    trainer.after_step = lambda _: exchange.release() if len(trainer.carry.losses) >= 8 else None
    first = trainer.run_window(next_lease, lambda: False)
    assert asked == [(None, False), (("a", start + 10 * span, size, True), True)]
    assert [(s.lease.lease_id, s.start, s.end, s.exhausted) for s in first.segments] == [
        ("a", start, start + 10 * span, False)]
    assert first.steps == 10 and first.filled == 8 and first.tokens == 10 * span
    # The carried steps: one on "a" with its tail, seven on "b"; committed with the next round.
    second = trainer.run_window(next_lease, lambda: False)
    got = [(s.lease.lease_id, s.start, s.end, s.exhausted) for s in second.segments]
    assert got[:2] == [("a", start + 10 * span, size, True), ("b", 0, got[1][2], False)]
    assert second.carried == 8 and second.carried_shards == [0, 1]
    # "b" goes on where the carry left it: one contiguous span, every token of both shards once.
    assert got[1][2] == (7 + second.steps) * span
    assert first.tokens + second.tokens == (size - start) + got[1][2]


def test_shared_state_round_trip_gives_a_joiner_the_same_state(dataset):
    cfg = _cfg(dataset, "streaming")
    (a,) = _trainers(cfg, dataset, 1)
    next_lease, _ = _leases([(s, dataset.shard_size(s)) for s in range(4)])
    for _ in range(2):
        a.run_window(next_lease, lambda: False)
    (joiner,) = _trainers(cfg, dataset, 1)
    assert joiner.global_hash() != a.global_hash()
    joiner.load_shared_tensors(dict(a.shared_tensors()))
    assert joiner.global_hash() == a.global_hash()
    assert (joiner.step, joiner.round) == (a.step, a.round)
    assert [f.rounds for f in joiner.sync.fragments] == [f.rounds for f in a.sync.fragments]
    mom_a = [f.outer.state_dict()["state"] for f in a.sync.fragments]
    mom_j = [f.outer.state_dict()["state"] for f in joiner.sync.fragments]
    for sa, sj in zip(mom_a, mom_j, strict=True):
        for k in sa:
            assert torch.equal(sa[k]["momentum_buffer"], sj[k]["momentum_buffer"])


def test_checkpoint_round_trip(dataset, tmp_path):
    cfg = _cfg(dataset, "diloco")
    (a,) = _trainers(cfg, dataset, 1)
    next_lease, _ = _leases([(0, dataset.shard_size(0))])
    a.run_window(next_lease, lambda: False)
    (b,) = _trainers(cfg, dataset, 1)
    b.load_state_dict(a.state_dict())
    assert b.global_hash() == a.global_hash() and b.round == a.round == 1
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_a_node_builds_its_trainer_and_reads_its_checkpoint_under_the_fork_guard(dataset, tmp_path):
    """A node builds its trainer and reads its checkpoint while its DHT's process starts
    (node/daemon/node.py), holding the fork guard the DHT's fork takes (protocol/fork_guard.py):
    the build never runs under that fork. The exchange is attached afterwards, and the checkpoint
    read is the one the state folder holds, applied later by the restore."""
    cfg = _cfg(dataset, "diloco")
    (source,) = _trainers(cfg, dataset, 1)
    next_lease, _ = _leases([(0, dataset.shard_size(0))])
    source.run_window(next_lease, lambda: False)
    state = StateDir(tmp_path / "state")
    state.save_checkpoint(source.state_dict())
    held: list[bool] = []

    class AtTheBuild(logging.Handler):  # the build_model fault's line is logged from the building thread
        def emit(self, record: logging.LogRecord) -> None:
            held.append(FORK_GUARD.locked())

    seen = AtTheBuild()
    faults_log = logging.getLogger("murmur.node.net.faults")
    faults_log.addHandler(seen)
    try:
        prepared = asyncio.run(prepare(
            cfg=cfg, dataset=dataset, device=torch.device("cpu"), state=state, node_id="n", settings=NodeSettings(),
            threads=1, faults=FaultInjector.parse(["delay:build_model:0.01"]),
        ))
    finally:
        faults_log.removeHandler(seen)
    assert held == [True] and not FORK_GUARD.locked()
    assert prepared.trainer.meter.inner is None  # attached once the data plane is open
    assert prepared.checkpoint is not None and prepared.checkpoint["shared"]["round"] == 1
    prepared.trainer.load_state_dict(prepared.checkpoint)
    assert prepared.trainer.global_hash() == source.global_hash()
