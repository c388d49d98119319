"""Stage-mates' sync rounds (node/pipeline/stage_sync.py) over the real exchange: real TLS peer
servers on loopback, one process, one loop. The rounds are called one by one here (the clock only
says when a round starts): a round that completes on one mate and fails on the other must not leave
their anchors apart."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time

import pytest
import torch
from _net_helpers import no_lost_task_exceptions  # noqa: F401 - a fixture

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.net.server import PeerServer
from murmur.node.pipeline.stage_sync import OuterAt, StageSync, due_round, newest, outer_name
from murmur.node.pipeline.worker import StageWorker
from murmur.optim.exchange import ExchangeError
from murmur.protocol.identity import CertificateAuthority
from murmur.protocol.runconfig import OptimSection, SyncSection

pytestmark = pytest.mark.timeout(150)  # a stage build imports torch._dynamo: over 60 s at load 30

RUN = "sync-test"
CFG = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=16), tie_embeddings=False)
OPTIM = OptimSection(lr=1e-3, warmup_steps=0, grad_clip=0.0)
SYNC = SyncSection(codec="fp32")  # outer lr 1, Nesterov momentum 0.5: momentum moves even idle rounds
PLAIN = SyncSection(codec="fp32", outer_lr=1.0, outer_momentum=0.0)  # configs/pipeline-cpu.toml's
EVERY_S = 2.0  # a round's deadline is 3/4 of it
KEY = "stage/0"


class Relay:
    """A TCP relay in front of a peer server. While ``cut``, a connection opened to it is taken
    and never answered (a firewall dropping new flows); the connections already open go on."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.cut = False
        self.address = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: list[asyncio.Task] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if self.cut:
            return  # held open, never read: the caller's handshake times out
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.append(up_writer)
        self._pipes += [asyncio.ensure_future(_pipe(reader, up_writer)),
                        asyncio.ensure_future(_pipe(up_reader, writer))]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._pipes:
            t.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for w in self._writers:
            w.close()
        if self._server is not None:
            await self._server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.close()


@dataclasses.dataclass
class Mate:
    sync: StageSync
    server: PeerServer
    worker: StageWorker
    faults: FaultInjector

    @property
    def node_id(self) -> str:
        return self.server.node_id

    def outer_hash(self) -> bytes:
        return self.sync.published().state_hash

    def train(self, seed: int) -> None:
        """Stands in for the microbatches the mate trains between two rounds."""
        g = torch.Generator().manual_seed(seed)
        with self.worker.lock, torch.no_grad():
            for p in self.worker.params:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)


@pytest.fixture
def two_mates():
    """Two peers of stage 0 with a stage sync each; the first reaches the second through a relay
    that the test can cut (the second reaches the first directly)."""
    with mates_with(SYNC) as got:
        yield got


@pytest.fixture
def two_averaging_mates():
    """The same with the outer step the pipelined configs ship: the mates' plain average."""
    with mates_with(PLAIN) as got:
        yield got


@contextlib.contextmanager
def mates_with(sync_cfg: SyncSection, bucket_mb: float = 16.0, every_s: float = EVERY_S, **by_samples):
    """``by_samples``: StageSync's ``every_samples`` and ``ledger`` (rounds by the run's samples)."""
    ca = CertificateAuthority.create("sync-test")
    loop = LoopThread()
    span = split_layers(CFG.n_layers, 2)[0]
    servers = [PeerServer(ca.issue(), run_id=RUN) for _ in range(2)]
    relay: Relay | None = None
    mates: list[Mate] = []
    try:
        for s in servers:
            loop.run(s.start())
        relay = Relay(servers[1].address)
        loop.run(relay.start())
        views = [
            {servers[0].node_id: servers[0].address, servers[1].node_id: relay.address},
            {s.node_id: s.address for s in servers},
        ]

        async def make(server: PeerServer, view: dict[str, str]) -> Mate:
            async def stage_mates(stage: int) -> dict[str, str]:
                return dict(view)

            faults = FaultInjector()
            sync = StageSync(server, sync_cfg, every_s, stage_mates, faults, bucket_mb=bucket_mb, **by_samples)
            worker = StageWorker(build_stage(CFG, 5, span), OPTIM, target_samples=1000)
            sync.reset(worker)
            return Mate(sync, server, worker, faults)

        for s, view in zip(servers, views, strict=True):
            mates.append(loop.run(make(s, view)))
        yield loop, mates, relay
    finally:
        for m in mates:
            loop.run(m.sync.aclose())
        if relay is not None:
            loop.run(relay.close())
        for s in servers:
            loop.run(s.stop())
        loop.stop()


def sync_round(loop: LoopThread, mates: list[Mate], r: int) -> list:
    """Round ``r`` on every mate at once: what each returned, or the error it failed with."""
    async def go():
        return await asyncio.gather(*[m.sync.round(r) for m in mates], return_exceptions=True)
    return loop.run(go(), timeout=30)


def same_weights(a: Mate, b: Mate) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.worker.params, b.worker.params, strict=True))


def test_a_round_that_failed_on_one_mate_only_is_made_up_within_one_round(two_mates):
    """Round 2 completes on one mate and fails on the other: the victim loses its reduced chunk
    (``lose_result``) and, the network to its mate refusing new flows meanwhile, cannot fetch the
    published result before its deadline. Its anchor and outer momentum stay at round 1 while its
    mate's step. Once the network is back, the next round must leave both with one state again."""
    loop, (victim, mate), relay = two_mates
    for r in (1, 2, 3, 4):
        victim.train(seed=2 * r)
        mate.train(seed=2 * r + 1)
        if r == 2:
            victim.faults.arm("lose_result", peer=victim.node_id, round=2)
            relay.cut = True
        got = sync_round(loop, [victim, mate], r)
        relay.cut = False
        if r == 2:  # the one-sided failure really happened
            assert ("lose_result", victim.node_id, 2) in victim.faults.fired
            assert got[1] is True, got
            assert isinstance(got[0], ExchangeError) and "did not complete" in str(got[0]), got
            assert victim.sync.last_round == 1 and mate.sync.last_round == 2
            assert victim.outer_hash() != mate.outer_hash()
            continue
        assert got == [True, True], got
        # No training during the round here: the weights are the anchor, the same on both.
        assert victim.outer_hash() == mate.outer_hash(), f"round {r}: the mates' anchors differ"
        assert same_weights(victim, mate), f"round {r}: the mates' weights differ"
    assert (victim.sync.rounds, mate.sync.rounds) == (3, 4)
    assert (victim.sync.adopted, mate.sync.adopted) == (1, 0)
    assert victim.sync.last_round == mate.sync.last_round == 4


def test_the_outer_state_to_adopt_is_the_latest_round_and_ties_go_to_the_smallest_hash():
    a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    own = OuterAt(5, b)
    assert newest(own, {}) is None
    assert newest(own, {"x": OuterAt(5, b), "y": OuterAt(4, a)}) is None  # an older mate never pulls back
    assert newest(own, {"x": OuterAt(6, c), "y": OuterAt(6, c), "z": OuterAt(5, a)}) == (OuterAt(6, c), ["x", "y"])
    # Two states at the latest round: every mate picks the same one, whichever it holds itself.
    assert newest(own, {"x": OuterAt(5, a), "y": OuterAt(5, c)}) == (OuterAt(5, a), ["x"])
    assert newest(OuterAt(5, a), {"x": OuterAt(5, b), "y": OuterAt(5, c)}) is None
    assert newest(OuterAt(5, c), {"x": OuterAt(5, b), "y": OuterAt(5, a)}) == (OuterAt(5, a), ["y"])


def test_a_stage_that_trained_nothing_keeps_its_weights_bit_for_bit_through_sync_rounds(two_mates):
    """Both mates train, then round 1 steps the anchor with Nesterov momentum 0.5. Then nobody
    trains: rounds 2-4 must make no outer step (the momentum alone moved the weights of an idle
    stage round after round), so the weights stay bit for bit. When one mate trains again, round 5
    steps."""
    loop, (a, b), _ = two_mates
    a.train(seed=1)
    b.train(seed=2)
    assert sync_round(loop, [a, b], 1) == [True, True]
    after = [p.detach().clone() for p in a.worker.params]
    momentum = [buf.clone() for buf in a.sync.momentum]
    assert any(m.abs().sum() > 0 for m in momentum)  # a momentum that would move an idle round
    for r in (2, 3, 4):
        assert sync_round(loop, [a, b], r) == [True, True]
        for m in (a, b):
            assert all(torch.equal(x, y) for x, y in zip(after, m.worker.params, strict=True)), f"round {r} moved"
        assert a.outer_hash() == b.outer_hash() and a.sync.last_round == b.sync.last_round == r
    assert (a.sync.idle_rounds, b.sync.idle_rounds) == (3, 3)
    a.train(seed=3)  # one mate trains: the stage trained, the round steps
    assert sync_round(loop, [a, b], 5) == [True, True]
    assert same_weights(a, b)  # both at the new anchor (no training during the round)
    assert not all(torch.equal(x, y) for x, y in zip(after, b.worker.params, strict=True))  # b took a's training
    assert (a.sync.idle_rounds, a.sync.rounds) == (3, 2)


def test_a_peer_alone_in_its_stage_holds_no_sync_state_until_a_mate_comes(two_mates):
    """A stage of one peer has nobody to average with: no anchor, no momentum, nothing published
    (they cost three copies of the stage). Its first round with a mate makes the anchor, and the
    two then agree as any mates do."""
    loop, (a, b), _ = two_mates
    with_mates = a.sync.mates

    async def just_me(stage: int) -> dict[str, str]:
        return {a.node_id: a.server.address}

    lone = a.sync
    lone.mates = just_me
    loop.run(_reset(lone, a.worker, alone=True))
    assert not lone.holds_state and lone.published() is None
    assert outer_name(0) not in a.server.states  # nothing for a joiner to fetch
    a.train(1)
    assert loop.run(lone.round(1), timeout=30) is False  # alone: skipped, still nothing held
    assert not lone.holds_state and outer_name(0) not in a.server.states
    # An eager peer found alone drops what it held at its first round.
    loop.run(_reset(lone, a.worker))
    assert lone.holds_state and outer_name(0) in a.server.states
    assert loop.run(lone.round(2), timeout=30) is False
    assert not lone.holds_state and lone.anchor == [] and outer_name(0) not in a.server.states
    # A mate comes: the anchor is made at the round's start, the round runs, within a round more
    # the two hold one outer state.
    lone.mates = with_mates
    assert sync_round(loop, [a, b], 3) == [True, True]
    assert a.sync.holds_state and a.sync.published() is not None
    sync_round(loop, [a, b], 4)
    assert a.outer_hash() == b.outer_hash()


async def _reset(sync: StageSync, worker, alone: bool = False) -> None:
    sync.reset(worker, alone=alone)


def test_plain_averaging_holds_nothing_between_rounds_and_leaves_the_mates_at_their_weighted_mean(
        two_averaging_mates):
    """Outer lr 1 without momentum over the lossless codec (the shipped pipelined configs): the
    round averages the weights themselves. Nothing is held or published between rounds (it was an
    anchor, a zero momentum and their published copies: four copies of the stage); after a round
    the mates hold the mean weighted by the samples each trained; a round in which nobody trained
    changes nothing, bit for bit; a round that failed on one side is made up by the next."""
    loop, (a, b), relay = two_averaging_mates
    assert a.sync.plain and not a.sync.holds_state and outer_name(0) not in a.server.states
    a.train(seed=1)
    b.train(seed=2)
    a.worker.stats.samples_total += 3  # a trained 3 samples since the last round, b 1: weights 4 and 2
    b.worker.stats.samples_total += 1
    want = [(4 * x + 2 * y) / 6 for x, y in zip(a.worker.params, b.worker.params, strict=True)]
    assert sync_round(loop, [a, b], 1) == [True, True]
    assert same_weights(a, b)
    assert all(torch.allclose(x, w, atol=1e-6) for x, w in zip(a.worker.params, want, strict=True))
    for m in (a, b):
        assert not m.sync.holds_state and outer_name(0) not in m.server.states and m.sync.published() is None
        # the round's result (the exchange serves it to a late mate) goes once the round's deadline passed
        assert [n for n in m.server.states if n.startswith("result/")] == [f"result/1/{KEY}"]
        assert m.sync.peak_round_bytes == 3 * sum(p.numel() * 4 for p in m.worker.params)  # snapshot, copy, result
    after = [p.detach().clone() for p in a.worker.params]
    assert sync_round(loop, [a, b], 2) == [True, True]  # nobody trained: bit for bit
    for m in (a, b):
        assert all(torch.equal(x, y) for x, y in zip(after, m.worker.params, strict=True))
    assert (a.sync.rounds, a.sync.idle_rounds) == (1, 1)
    # One side fails round 3 after training: the next round, with nobody training, still averages.
    b.train(seed=3)
    a.faults.arm("lose_result", peer=a.node_id, round=3)
    relay.cut = True
    got = sync_round(loop, [a, b], 3)
    relay.cut = False
    assert isinstance(got[0], ExchangeError) and got[1] is True, got
    assert sync_round(loop, [a, b], 4) == [True, True]
    assert same_weights(a, b) and a.sync.last_round == b.sync.last_round == 4
    # Round 3's result, published by the mate that completed it, went with round 4: results of
    # failed or skipped rounds in between used to stay (one copy of the stage each).
    for m in (a, b):
        assert [n for n in m.server.states if n.startswith("result/")] == [f"result/4/{KEY}"]
    loop.run(asyncio.sleep(0.75 * EVERY_S + 0.2))  # past round 4's deadline: nothing kept
    assert not [n for m in (a, b) for n in m.server.states if n.startswith("result/")]


def test_an_outer_step_with_an_anchor_publishes_it_without_a_copy(two_mates):
    """Another outer step (momentum here) keeps the anchor and the momentum, and publishes those
    tensors themselves; without momentum (a lossy codec's plain average) no momentum is kept."""
    loop, (a, b), _ = two_mates
    a.train(seed=1)
    b.train(seed=2)
    assert sync_round(loop, [a, b], 1) == [True, True]
    published = dict(a.server.states[outer_name(0)].tensors)
    names = [n for n, _ in a.worker.module.named_stage_parameters()]
    for n, x, m in zip(names, a.sync.anchor, a.sync.momentum, strict=True):
        assert published["anchor/" + n].data_ptr() == x.data_ptr()
        assert published["momentum/" + n].data_ptr() == m.data_ptr()
    with mates_with(SyncSection(codec="int8", outer_lr=1.0, outer_momentum=0.0)) as (loop8, (c, d), _):
        assert not c.sync.plain
        c.train(seed=1)
        d.train(seed=2)
        assert sync_round(loop8, [c, d], 1) == [True, True]
        assert same_weights(c, d) and c.sync.momentum is None
        assert not any(n.startswith("momentum/") for n, _ in c.server.states[outer_name(0)].tensors)


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage the collector can see now, alive or garbage not collected
    yet (each storage once): what the process's tensors hold."""
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":  # type(): no module proxy asked
            try:
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            except RuntimeError:  # a tracing or vmap tensor (FakeTensor, BatchedTensorImpl) another test
                continue  # of this worker left: no storage of its own
    return sum(seen.values())


def test_failed_rounds_on_the_clock_leave_none_of_their_tensors_behind(two_averaging_mates):
    """Rounds on the clock (`StageSync.run`) that fail, one after another (the mate's address never
    answers): a failed round's snapshot, its exchange copy and result, held in reference cycles by
    its exception, used to stay until a full collection (over 2 GiB after ten failed rounds of an 80
    MiB stage under load). Each is released when its round ends: the process's tensors do not grow
    by a copy of the stage."""
    loop, (a, _b), relay = two_averaging_mates
    stage_bytes = sum(p.numel() * p.element_size() for p in a.worker.params)
    a.train(seed=1)
    a.worker.stats.samples_total += 1
    relay.cut = True  # a reaches its mate only through the relay: every round fails at its deadline

    async def tensors_now() -> int:  # on the loop, between its tasks: no round half-way through a line
        return live_tensor_bytes()

    gc.collect()
    before = loop.run(tensors_now())
    task = loop.run(_start(a.sync))
    try:
        wait_until_true(lambda: a.sync.failed >= 2, timeout_s=60)
        after = loop.run(tensors_now())
    finally:
        loop.run(_cancel(task))
    assert a.sync.failed >= 2 and a.sync.rounds == 0, (a.sync.failed, a.sync.last_error)
    assert after - before < stage_bytes, (before, after, stage_bytes)


async def _start(sync: StageSync) -> asyncio.Task:
    return asyncio.ensure_future(sync.run())


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def wait_until_true(ok, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- rounds by the run's samples -------------------------------------------------------------------


def test_a_round_is_due_at_each_multiple_of_samples_passed_or_at_a_still_total():
    every, s = 32, EVERY_S
    assert due_round(0, every, 0, 0.0, s) is None  # a new run: nothing trained
    assert due_round(31, every, 0, 0.0, s) is None
    assert due_round(32, every, 0, 0.0, s) == 32  # round 32 once the ledger passes 32 samples
    assert due_round(40, every, 32, 0.0, s) is None  # started already
    # A ledger that jumped several multiples (a long round, a late poll): each in turn, so that a
    # mate that heard 40 and one that heard 200 both run 64 next.
    assert due_round(200, every, 32, 0.0, s) == due_round(64, every, 32, 0.0, s) == 64
    assert [due_round(200, every, r, 0.0, s) for r in (64, 96, 128, 160)] == [96, 128, 160, 192]
    # A peer that becomes the stage at 200 counts from 192 (StageSync.reset): its first round is 224.
    assert due_round(223, every, 192, 0.0, s) is None and due_round(224, every, 192, 0.0, s) == 224
    # Still for a period with samples past the last round: a round at the total itself, between
    # two multiples; once started, none more until the ledger moves.
    assert due_round(200, every, 192, s - 0.1, s) is None
    assert due_round(200, every, 192, s, s) == 200
    assert due_round(200, every, 200, 10 * s, s) is None
    assert due_round(224, every, 200, 0.0, s) == 224  # the next multiple as usual
    # A ledger still at the multiple its last round ran at: nothing trained since, no round.
    assert due_round(224, every, 224, 10 * s, s) is None


def test_mates_syncing_by_samples_round_at_the_multiples_the_ledger_passes(two_averaging_mates_by_samples):
    """Two mates' run loops (StageSync.run) on one ledger: no round while it is below the first
    multiple, one round at 32 on both once it passes it, a round at each multiple up to 192 when it
    jumps to 200 (the first averaging what both trained, the others idle), and once it stands still
    a period at 210, one round there that averages what was trained since: then both hold one
    state."""
    loop, (a, b), ledger = two_averaging_mates_by_samples

    def trained(m: Mate, seed: int) -> None:
        m.train(seed)
        m.worker.stats.samples_total += 4  # what a round weighs each mate by

    tasks = [loop.run(_start(m.sync)) for m in (a, b)]
    try:
        ledger[0] = 20
        trained(a, 1)
        ledger[0] = 40
        wait_until_true(lambda: a.sync.last_round == b.sync.last_round == 32, timeout_s=60)
        assert a.sync.rounds == b.sync.rounds == 1 and same_weights(a, b)
        trained(a, 2)
        trained(b, 3)
        ledger[0] = 200
        wait_until_true(lambda: a.sync.last_round >= 192 and b.sync.last_round >= 192, timeout_s=60)
        # 64 averaged what both trained; 96-192 (and a still round at 200, if it came meanwhile)
        # found nothing trained since and changed nothing.
        assert (a.sync.rounds, min(a.sync.idle_rounds, 4)) == (2, 4) and same_weights(a, b)
        # (A still round at 200 may come meanwhile: nobody trained since 192, it changes nothing.)
        trained(a, 4)
        ledger[0] = 210  # then still: a round at 210 averages a's training into b
        wait_until_true(lambda: a.sync.last_round == b.sync.last_round == 210, timeout_s=60)
        assert same_weights(a, b) and a.sync.rounds == 3 and a.sync.failed == b.sync.failed == 0
    finally:
        for t in tasks:
            loop.run(_cancel(t))


@pytest.fixture
def two_averaging_mates_by_samples():
    ledger = [0]
    # A round's deadline of 3.75 s, not EVERY_S's 1.5: each mate starts a still ledger's round when
    # its own look at the ledger has seen it still for a period, and in the whole suite's load two
    # looks 1.5 s apart made the round at 210 fail on both (the ledger then still, no retry).
    with mates_with(PLAIN, every_s=5.0, every_samples=32, ledger=lambda: ledger[0]) as (loop, mates, _relay):
        yield loop, mates, ledger
