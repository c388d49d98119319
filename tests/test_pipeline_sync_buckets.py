"""A within-stage sync round in parts (node/pipeline/sync_buckets.py): the cut, and a round by
parts against a round of the whole stage on the same inputs, over the real exchange (real TLS peer
servers on loopback, one process): the same weights and outer state, and a part that fails on one
mate only made up within a round."""

from __future__ import annotations

import pytest
import torch
from _net_helpers import no_lost_task_exceptions  # noqa: F401 - a fixture
from test_pipeline_sync import PLAIN, SYNC, mates_with, same_weights, sync_round

from murmur.node.pipeline.stage_sync import OuterAt, newest
from murmur.node.pipeline.sync_buckets import MIB, Piece, cut, elements_of, is_part_of, part_key, views
from murmur.optim.exchange import ExchangeError
from murmur.protocol.runconfig import SyncSection

pytestmark = pytest.mark.timeout(150)

INT8 = SyncSection(codec="int8", outer_lr=1.0, outer_momentum=0.0)  # configs/pipeline-gpu.toml's codec


def test_the_cut_covers_every_element_once_in_parts_of_at_most_the_bound():
    numels = [10, 3, 25, 1]
    parts = cut(numels, 8)
    assert all(sum(p.hi - p.lo for p in part) <= 8 for part in parts)
    assert len(parts) == 5  # 39 elements, 8 a part
    covered = [(p.index, i) for part in parts for p in part for i in range(p.lo, p.hi)]
    assert covered == [(t, i) for t, n in enumerate(numels) for i in range(n)]
    whole = [[Piece(0, 0, 10), Piece(1, 0, 3), Piece(2, 0, 25), Piece(3, 0, 1)]]
    assert cut(numels, 0) == whole and cut(numels, 39) == whole  # no bound, or everything fits
    assert elements_of(1.0) == MIB // 4 and elements_of(0) == 0
    # views write the tensors themselves
    ts = [torch.zeros(2, 5), torch.zeros(3)]
    for v in views(ts, cut([10, 3], 4)[1]):
        v.fill_(1)
    assert ts[0].reshape(-1).tolist() == [0] * 4 + [1] * 4 + [0, 0] and ts[1].tolist() == [0, 0, 0]
    assert part_key("stage/0", 0, 1) == "stage/0" and part_key("stage/0", 2, 3) == "stage/0/part2"
    assert is_part_of("stage/0/part2", "stage/0") and is_part_of("stage/0", "stage/0")
    assert not is_part_of("stage/0/final", "stage/0") and not is_part_of("stage/0/final/part1", "stage/0")


def _two_rounds(sync_cfg: SyncSection, bucket_mb: float):
    """Two rounds of two mates, each training between them (the same seeds whatever the parts):
    the mates' weights and anchors after, the parts a round and the most a round held."""
    with mates_with(sync_cfg, bucket_mb) as (loop, (a, b), _):
        for r in (1, 2):
            a.train(seed=10 * r)
            b.train(seed=10 * r + 1)
            a.worker.stats.samples_total += 3
            b.worker.stats.samples_total += 1
            assert sync_round(loop, [a, b], r) == [True, True]
        stage_bytes = sum(p.numel() * 4 for p in a.worker.params)
        return ([[p.detach().clone() for p in m.worker.params] for m in (a, b)],
                [[x.clone() for x in m.sync.anchor] for m in (a, b)], a.sync.parts, a.sync.peak_round_bytes,
                stage_bytes)


@pytest.mark.parametrize("sync_cfg, exact", [(PLAIN, True), (SYNC, True), (INT8, False)],
                         ids=["plain-averaging", "nesterov-momentum", "int8"])
def test_a_round_in_parts_gives_what_a_whole_round_gives(sync_cfg, exact):
    """The outer step, the averaging and the rebase are element by element: a round in parts
    leaves the weights (and the anchor) a whole round leaves, within fp32 rounding over the lossless
    codec; over int8 (its scale is a chunk's, and the parts cut the chunks elsewhere) within its error.
    Each part holds a part's copies, not the stage's."""
    w_whole, a_whole, parts_whole, peak_whole, stage_bytes = _two_rounds(sync_cfg, 0.0)
    bucket_mb = stage_bytes / 5 / MIB  # five parts
    w_parts, a_parts, parts, peak_parts, _ = _two_rounds(sync_cfg, bucket_mb)
    assert parts_whole == 1 and parts in (5, 6)  # 6: the MiB rounded down to whole elements
    assert peak_whole == 3 * stage_bytes and peak_parts <= 3 * elements_of(bucket_mb) * 4 + 12
    for got, want in [*zip(w_parts, w_whole, strict=True), *zip(a_parts, a_whole, strict=True)]:
        for x, y in zip(got, want, strict=True):
            # fp32: within rounding (the exchange's owner sums the mates' inputs in the order they
            # arrive, so even two whole rounds may differ in the last bit); int8 of a pseudo-gradient
            # of about 1e-2 a step: a few 1e-4 a chunk
            assert torch.allclose(x, y, rtol=0, atol=1e-6 if exact else 2e-3), (x - y).abs().max()


def test_a_part_that_failed_on_one_mate_only_is_made_up_within_one_round():
    """Round 2's first part completes on one mate and fails on the other (it loses its reduced
    chunk and cannot fetch the result, the network cut), so the first mate's next part fails too:
    both at round 1, one with the first part of round 2 in its anchor. The outer state says so
    (``parts``), the other adopts it with its own failed part's training kept as a completed round
    keeps it, and the next round leaves both with one state again."""
    with mates_with(SYNC, bucket_mb=0.02) as (loop, (victim, mate), relay):
        for r in (1, 2, 3, 4):
            victim.train(seed=2 * r)
            mate.train(seed=2 * r + 1)
            if r == 2:
                victim.faults.arm("lose_result", peer=victim.node_id, round=2)
                relay.cut = True
            got = sync_round(loop, [victim, mate], r)
            relay.cut = False
            assert victim.sync.parts > 2
            if r == 2:
                assert isinstance(got[0], ExchangeError) and isinstance(got[1], ExchangeError), got
                assert victim.sync.last_round == mate.sync.last_round == 1
                assert mate.sync._partial[0] == 2 and mate.sync._partial[1] >= 1
                assert victim.outer_hash() != mate.outer_hash()
                continue
            assert got == [True, True], got
            assert victim.outer_hash() == mate.outer_hash(), f"round {r}: the mates' anchors differ"
            assert same_weights(victim, mate), f"round {r}: the mates' weights differ"
        assert (victim.sync.adopted, mate.sync.adopted) == (1, 0)
        assert victim.sync.last_round == mate.sync.last_round == 4


def test_a_state_with_parts_of_a_later_round_is_adopted_over_one_without():
    """Mates at the same round, one with the first parts of the next round in its anchor (that
    round failed there after them): the one with more parts wins, whatever the hashes; a later
    round still wins over any parts."""
    lo, hi = b"\x01" * 32, b"\x02" * 32
    without, with_one = OuterAt(5, lo), OuterAt(5, hi, (6, 1))
    assert newest(without, {"x": with_one}) == (with_one, ["x"])
    assert newest(with_one, {"x": without}) is None
    assert newest(with_one, {"x": OuterAt(5, lo, (6, 2))}) == (OuterAt(5, lo, (6, 2)), ["x"])
    assert newest(with_one, {"x": OuterAt(6, hi)}) == (OuterAt(6, hi), ["x"])
