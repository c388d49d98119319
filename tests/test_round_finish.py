"""The round finisher: a round reaches the loop only after its checkpoint is on disk, in order, and a
failed write stops the node without handing over that round or any later one. Its state is
published once hashed, whatever the disk does."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from murmur.node.daemon import snapshot
from murmur.node.daemon.round_finish import MAX_WAITING, RoundFinisher
from murmur.node.daemon.shared_state import shared_state_hash
from murmur.node.daemon.state_dir import StateDir
from murmur.protocol.wire import tensors_hash


def _shared(value: float) -> list[tuple[str, torch.Tensor]]:
    return [("param/w", torch.full((4,), value)), ("counters", torch.tensor([1, 2]))]


def test_rounds_are_handed_over_in_order_each_after_its_checkpoint_with_both_hashes(tmp_path):
    state = StateDir(tmp_path)
    events: list[tuple[str, int]] = []

    def save(ckpt, rounds):
        state.save_checkpoint(ckpt)
        events.append(("saved", ckpt["round"]))

    def hand_over(record, commits, shared, digest):
        # A checkpoint of this round (or of a later one, which holds its state) is readable from
        # disk when the loop gets the round.
        if record["round"] % 2 == 0:
            assert state.load_checkpoint()["round"] >= record["round"]
        assert record["hash"] == shared_state_hash(shared) == tensors_hash(shared[:1]).hex()
        assert digest == tensors_hash(shared)
        events.append(("handed", record["round"]))

    finisher = RoundFinisher(save, hand_over)
    for r in range(1, 7):
        ckpt = {"round": r, "w": torch.ones(3)} if r % 2 == 0 else None
        finisher.submit({"round": r, "hash": None}, [], _shared(float(r)), ckpt)
    finisher.close()
    handed = [r for kind, r in events if kind == "handed"]
    assert handed == [1, 2, 3, 4, 5, 6]
    saved = [r for kind, r in events if kind == "saved"]
    assert saved == sorted(saved) and saved[-1] == 6  # the last round's is never dropped
    for r in (2, 4, 6):
        assert any(events.index(("saved", s)) < events.index(("handed", r)) for s in saved if s >= r)


def test_a_failed_checkpoint_write_hands_over_neither_its_round_nor_later_ones_and_raises(tmp_path):
    handed: list[int] = []
    written = threading.Event()
    submitted = threading.Event()

    def save(ckpt, rounds):
        written.set()
        # fails only once round 3 is in: failing earlier, the write's error is (rightly) raised by
        # submit(3) itself, which test_the_next_submit_raises_the_earlier_failure covers
        assert submitted.wait(30)
        raise OSError(28, "No space left on device")

    finisher = RoundFinisher(save, lambda record, *_: handed.append(record["round"]))
    finisher.submit({"round": 1}, [], _shared(1.0), None)
    finisher.submit({"round": 2}, [], _shared(2.0), {"round": 2})
    finisher.submit({"round": 3}, [], _shared(3.0), None)
    submitted.set()
    assert written.wait(30)
    with pytest.raises(OSError, match="No space left"):
        finisher.close()
    assert handed == [1]


def test_the_next_submit_raises_the_earlier_failure(tmp_path):
    failed = threading.Event()

    def save(ckpt, rounds):
        failed.set()
        raise OSError(5, "Input/output error")

    finisher = RoundFinisher(save, lambda *_: None)
    finisher.submit({"round": 1}, [], _shared(1.0), {"round": 1})
    assert failed.wait(30)
    with finisher._cv:  # the failing round has returned
        assert finisher._cv.wait_for(lambda: not finisher._busy and not finisher._waiting, 30)
    with pytest.raises(OSError, match="Input/output"):
        finisher.submit({"round": 2}, [], _shared(2.0), None)
    finisher.close(raise_failure=False)


def test_a_snapshot_is_not_moved_by_later_in_place_updates():
    live = {"model": {"w": torch.zeros(3)}, "opt": [torch.ones(2)], "step": 4, "pair": (torch.ones(1), "x")}
    snap = snapshot.take(live)
    live["model"]["w"].add_(5)
    live["opt"][0].mul_(3)
    live["pair"][0].sub_(1)
    assert torch.equal(snap["model"]["w"], torch.zeros(3))
    assert torch.equal(snap["opt"][0], torch.ones(2))
    assert torch.equal(snap["pair"][0], torch.ones(1)) and snap["pair"][1] == "x" and snap["step"] == 4


def test_a_checkpoint_waiting_behind_a_slow_write_gives_way_to_the_next_rounds_and_training_goes_on(tmp_path):
    # A slow disk must not hold the training thread: the waiting checkpoint is dropped for the
    # newer one, and its round reaches the loop only once the newer checkpoint is on disk.
    state = StateDir(tmp_path)
    release, started = threading.Event(), threading.Event()
    events: list[tuple[str, int]] = []
    holds: list[list[int]] = []

    def save(ckpt, rounds):
        started.set()
        if ckpt["round"] == 1:
            assert release.wait(30)
        state.save_checkpoint(ckpt)
        events.append(("saved", ckpt["round"]))
        holds.append(rounds)

    def hand_over(record, *_):
        events.append(("handed", record["round"], state.load_checkpoint()["round"]))

    finisher = RoundFinisher(save, hand_over)
    finisher.submit({"round": 1}, [], _shared(1.0), {"round": 1})
    assert started.wait(30)
    submitted = threading.Event()

    def more():
        for r in (2, 3):
            finisher.submit({"round": r}, [], _shared(float(r)), {"round": r})
        submitted.set()

    t = threading.Thread(target=more)
    t.start()
    assert submitted.wait(30), "a submit waited for the disk"
    assert events == [] and finisher.superseded == 1
    release.set()
    finisher.close()
    t.join(30)
    # Round 2's checkpoint was never written; round 2 went out after round 3's, which holds its state.
    assert events == [("saved", 1), ("handed", 1, 1), ("saved", 3), ("handed", 2, 3), ("handed", 3, 3)]
    # Round 3's write says it holds round 2 too: ``--fault delay:checkpoint:S@2`` strikes it
    # (tests/test_churn_catchup.py held round 2's write and waited for ever when it was replaced).
    assert holds == [[1], [2, 3]]


def test_states_are_published_in_order_while_a_slow_write_holds_the_hand_overs(tmp_path):
    # A peer serves its newest state to joiners whatever its disk does: published only after the
    # checkpoint, a lagging state sent a joiner round after round into results its holder had
    # dropped (tests/test_churn_catchup.py).
    release, started = threading.Event(), threading.Event()
    published: list[tuple[int, bytes]] = []
    handed: list[int] = []

    def save(ckpt, rounds):
        started.set()
        assert release.wait(30)

    finisher = RoundFinisher(save, lambda record, *_: handed.append(record["round"]),
                             lambda round_id, shared, digest: published.append((round_id, digest)))
    for r in range(1, MAX_WAITING + 1):
        finisher.submit({"round": r}, [], _shared(float(r)), {"round": r})
    assert started.wait(30)
    deadline = time.monotonic() + 30
    while len(published) < MAX_WAITING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r for r, _ in published] == list(range(1, MAX_WAITING + 1)) and handed == []
    assert all(d == tensors_hash(_shared(float(r))) for r, d in published)
    release.set()
    finisher.close()
    assert handed == list(range(1, MAX_WAITING + 1))


def test_a_submit_blocks_only_once_max_waiting_rounds_wait_unhashed(tmp_path):
    release, started = threading.Event(), threading.Event()

    def save(ckpt, rounds):
        started.set()
        assert release.wait(30)

    finisher = RoundFinisher(save, lambda *_: None)
    finisher.submit({"round": 0}, [], _shared(0.0), {"round": 0})
    assert started.wait(30)
    for r in range(1, MAX_WAITING + 1):
        finisher.submit({"round": r}, [], _shared(float(r)), {"round": r})
    last_in = threading.Event()
    t = threading.Thread(target=lambda: (finisher.submit({"round": 9}, [], _shared(9.0), None), last_in.set()))
    t.start()
    assert not last_in.wait(0.5)  # memory stays bounded: the worker has not taken a round since
    release.set()
    assert last_in.wait(30)
    t.join(30)
    finisher.close()


def test_drain_returns_once_every_submitted_round_is_handed_over(tmp_path):
    # The training thread drains before asking for a lease: the coordinator must see the last
    # window's commits first (a shard that ran out is handed back until its commit says so).
    release = threading.Event()
    handed: list[int] = []

    def save(ckpt, rounds):
        release.wait(30)

    finisher = RoundFinisher(save, lambda record, *_: handed.append(record["round"]))
    finisher.submit({"round": 1}, [], _shared(1.0), {"round": 1})
    finisher.submit({"round": 2}, [], _shared(2.0), None)
    drained = threading.Event()
    t = threading.Thread(target=lambda: (finisher.drain(), drained.set()))
    t.start()
    assert not drained.wait(0.5) and handed == []
    release.set()
    assert drained.wait(30)
    assert handed == [1, 2]
    t.join(30)
    finisher.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_snapshot_of_gpu_tensors_is_a_finished_page_locked_copy_the_gpu_cannot_move():
    g = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    state = {"tensors": {"a": g, "b": g[::2].to(torch.bfloat16)}, "list": [g[:3]], "step": 7}
    snap = snapshot.take(state)
    g.add_(1.0)  # the next window's in-place update, queued right after the copies
    assert snap["step"] == 7
    a, b, (c,) = snap["tensors"]["a"], snap["tensors"]["b"], snap["list"]
    assert a.device.type == b.device.type == "cpu" and a.is_pinned() and b.dtype == torch.bfloat16
    assert torch.equal(a, torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(b, torch.arange(0, 1 << 20, 2, dtype=torch.float32).to(torch.bfloat16))
    assert c.tolist() == [0.0, 1.0, 2.0]


def test_snapshots_stay_on_the_cpu_where_there_is_no_gpu():
    assert not snapshot.room_on_device(torch.device("cpu"), 1 << 20)
    assert snapshot.nbytes({"a": torch.ones(4), "b": [torch.ones(2, dtype=torch.float64)], "n": 3}) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_snapshots_reach_the_loop_as_page_locked_cpu_copies_of_the_round_not_of_the_next_window(tmp_path):
    g = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
    m = torch.ones(1 << 20, device="cuda")
    state = {"tensors": {"global/w": g}, "step": 3}
    taken_state = snapshot.take(state, on_device=True)
    shared = [("global/w", taken_state["tensors"]["global/w"]), ("counters", torch.tensor([3, 1]))]
    checkpoint = {"round": 1, "model": snapshot.take({"m": m}, on_device=True), "shared": taken_state}
    assert snapshot.nbytes(checkpoint) == (1 << 22) * 4 + (1 << 20) * 4
    taken = snapshot.Taken.now(g.device)
    for _ in range(20):  # the next window's in-place updates, queued before the finisher copies
        g.mul_(1.0001).add_(1.0)
        m.add_(1.0)
    handed, saved = [], []
    finisher = RoundFinisher(lambda ckpt, rounds: saved.append(ckpt),
                             lambda record, commits, sh, digest: handed.append((record, sh)))
    finisher.submit({"round": 1}, [], shared, checkpoint, taken)
    finisher.close()
    (record, sh), (ckpt,) = handed[0], saved
    w = dict(sh)["global/w"]
    assert w.device.type == "cpu" and w.is_pinned()
    assert torch.equal(w, torch.arange(1 << 22, dtype=torch.float32))
    assert record["hash"] == tensors_hash([("global/w", w)]).hex()
    # One CPU copy of the state, reached from the list, the checkpoint and the training thread's dict.
    assert ckpt["shared"]["tensors"]["global/w"] is w and taken_state["tensors"]["global/w"] is w
    assert torch.equal(ckpt["model"]["m"], torch.ones(1 << 20)) and ckpt["model"]["m"].is_pinned()
