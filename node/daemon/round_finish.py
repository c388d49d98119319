"""What follows a completed round, off the training thread: hashes and the published state, then
the local checkpoint and the hand-over to the daemon's loop (round record, commits).

On a GPU the next window's compute is the scarce thing. Hashing the global state (sha256 over
every parameter, twice: the round's hash and the published state's), and writing a checkpoint of
model, optimizer and state (~1.5 GB for the 124M-parameter preset, fsynced) took seconds per round
on the training thread (benchmarks/results/node_gpu.json). The training thread now only copies what
the next window will overwrite (a snapshot on the CPU) and hands it to two worker threads: one
hashes each round and publishes its state (``publish``: served to joiners and laggards, announced
in the DHT and the heartbeats), the other writes the checkpoints and hands the rounds over, while
the next window trains.

Order is what keeps work safe: rounds go through both workers first in, first out, and a round's
record and commits reach the loop only after a checkpoint that holds its state is on disk. A
commit the coordinator acknowledges is therefore never ahead of the checkpoint a restarted node
resumes from, as before. The published state does not wait for the disk: it is the run's state
(its round was granted before it was applied), whoever holds it. Published after the checkpoint,
it lagged the exchange by the rounds waiting for the disk, and a peer serves only its last two
results: a joiner that took the lagging state needed a result its holder had dropped, re-synced to
the same state, and tried again every ~70 ms for as long as the write took
(tests/test_churn_catchup.py).

A slow disk does not slow training. At most one checkpoint waits beside the one being written
(memory stays bounded); a newer round's checkpoint replaces the waiting one, and the rounds whose
checkpoint was replaced are handed over together with the round whose checkpoint covers them. A
base-preset node on a GPU writes a ~2 GB fsynced checkpoint every few seconds, which a volunteer's
disk need not keep up with (on the H200 it did: no submit waited). Only when MAX_WAITING rounds
wait unsaved (hashed or not) does a submit block.
A failed write stops the node at the next hand-over with the write's own error, and neither the
round it belonged to nor any round waiting on it is logged, committed or published.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from murmur.node.daemon import snapshot
from murmur.node.daemon.shared_state import shared_state_hash
from murmur.protocol.wire import tensors_hash

# (record, commits, shared tensors, their digest): what the loop takes from a finished round.
HandOver = Callable[[dict[str, Any], list, list[tuple[str, torch.Tensor]], bytes], None]
# (checkpoint, the rounds it holds: its own and those whose checkpoints it replaced): a write.
SaveCheckpoint = Callable[[dict[str, Any], list[int]], None]
# (round, shared tensors, their digest): a round's state, hashed, to serve and announce.
Publish = Callable[[int, list[tuple[str, torch.Tensor]], bytes], None]


MAX_WAITING = 3  # rounds submitted and not yet being saved before a submit blocks


@dataclass
class _Round:
    record: dict[str, Any]
    commits: list
    shared: list[tuple[str, torch.Tensor]]
    checkpoint: dict[str, Any] | None
    taken: snapshot.Taken | None  # shared and checkpoint are GPU copies, complete once it passed
    superseded: bool = False  # its checkpoint was dropped for a newer round's
    digest: bytes = b""


class RoundFinisher:
    def __init__(
        self, save_checkpoint: SaveCheckpoint, hand_over: HandOver, publish: Publish | None = None
    ) -> None:
        self._save, self._hand_over, self._publish = save_checkpoint, hand_over, publish
        self._cv = threading.Condition()
        self._waiting: deque[_Round] = deque()  # submitted, not yet taken by the hasher
        self._unsaved: deque[_Round] = deque()  # hashed and published, not yet taken by the saver
        self._hashing = False  # the hasher holds a round
        self._in_hasher: _Round | None = None  # which one: not being saved either, so it can be superseded
        self._busy = False  # the saver holds a round (writing or handing over)
        self._closing = False
        self._failed: BaseException | None = None
        self.superseded = 0  # checkpoints dropped for a newer round's (the rounds were handed over with it)
        self._host = snapshot.HostMover()
        self._hasher = threading.Thread(target=self._hash_rounds, name="round-hash", daemon=True)
        self._worker = threading.Thread(target=self._work, name="round-finish", daemon=True)
        self._hasher.start()
        self._worker.start()

    def submit(
        self,
        record: dict[str, Any],
        commits: list,
        shared: list[tuple[str, torch.Tensor]],
        checkpoint: dict[str, Any] | None,
        taken: snapshot.Taken | None = None,
    ) -> None:
        """Finish a round (training thread). ``shared`` must be tensors nobody writes any more and
        ``checkpoint`` a `NodeTrainer.state_dict`: CPU copies, or GPU copies (node/daemon/snapshot.py)
        with ``taken`` marked after them on the training stream; the worker moves those to the
        CPU, in place, before anything else. Raises the error of an earlier round's failed write."""
        self._raise_failure()
        with self._cv:
            # The round the hasher holds counts too: it is submitted and not yet being saved.
            while len(self._waiting) + self._hashing + len(self._unsaved) >= MAX_WAITING and self._failed is None:
                self._cv.wait()
            if checkpoint is not None:
                # Every round not being saved yet: this round's checkpoint covers it. The hasher's
                # too, whatever the hasher's pace (it only moves the checkpoint's tensors, through
                # its own reference): which checkpoints are written must not depend on the load.
                held = (self._in_hasher,) if self._in_hasher is not None else ()
                for r in (*self._waiting, *held, *self._unsaved):
                    if r.checkpoint is not None:
                        r.checkpoint, r.superseded = None, True
                        self.superseded += 1
            self._waiting.append(_Round(record, commits, shared, checkpoint, taken))
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every round submitted so far is handed over (training thread). A lease
        request after a lost or dropped lease must come after the last windows' commits: the
        coordinator hands the shard back from its committed offset. Raises the error of a failed
        write."""
        with self._cv:
            while (self._waiting or self._unsaved or self._hashing or self._busy) and self._failed is None:
                self._cv.wait()
        self._raise_failure()

    def close(self, *, raise_failure: bool = True) -> None:
        """Wait for every submitted round (its checkpoint, then its hand-over); raise a failure
        unless the caller is already leaving with an error of its own."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._hasher.join()
        self._worker.join()
        if raise_failure:
            self._raise_failure()

    def _raise_failure(self) -> None:
        with self._cv:
            err, self._failed = self._failed, None
        if err is not None:
            raise err

    def _hash_rounds(self) -> None:
        """The hasher: each round's hashes, then its state published, in order."""
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if not self._waiting:
                    self._cv.notify_all()  # the saver ends once nothing more comes
                    return
                r = self._waiting.popleft()
                self._hashing, self._in_hasher = True, r
            try:
                if self._failed is None:  # nothing after a failed write is published either
                    self._hash(r)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                with self._cv:
                    self._failed = err
            finally:
                with self._cv:
                    if self._failed is None:
                        self._unsaved.append(r)
                    self._hashing, self._in_hasher = False, None
                    self._cv.notify_all()

    def _hash(self, r: _Round) -> None:
        if r.taken is not None:
            # In place: the training thread's copy of the shared state (the one a failed round is
            # undone from) is this dict too, and lets go of the GPU memory with it.
            self._host.to_host([r.shared, r.checkpoint], r.taken)
        r.record["hash"] = shared_state_hash(r.shared)
        r.digest = tensors_hash(r.shared)
        # The whole shared state's hash (with the outer momentum and counters): what the node
        # announces in its heartbeats and peer record, what a joiner's fetch is checked against and
        # what the status page shows; "hash" above is the model's alone, as an export records it.
        r.record["shared_hash"] = r.digest.hex()
        if self._publish is not None:
            self._publish(int(r.record["round"]), r.shared, r.digest)

    def _work(self) -> None:
        """The saver: checkpoints, then the hand-overs, in order."""
        held: list[_Round] = []  # hashed, waiting for a later round's checkpoint to cover them
        while True:
            with self._cv:
                while not self._unsaved and not (self._closing and not self._waiting and not self._hashing):
                    self._cv.wait()
                if not self._unsaved:
                    return
                r = self._unsaved.popleft()
                self._busy = True
                self._cv.notify_all()  # room for a blocked submit
            try:
                if self._failed is None:  # a round after a failed write is not handed over either
                    self._finish(r, held)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                held.clear()
                with self._cv:
                    self._failed = err
            finally:
                r.checkpoint = None  # the snapshot's memory goes back now, not with the next round
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _finish(self, r: _Round, held: list[_Round]) -> None:
        if r.superseded or (held and r.checkpoint is None):
            held.append(r)  # a later round's checkpoint holds this round's state: hand over with it
            return
        if r.checkpoint is not None:
            self._save(r.checkpoint, [int(d.record["round"]) for d in (*held, r)])
        for done in (*held, r):
            self._hand_over(done.record, done.commits, done.shared, done.digest)
        held.clear()
