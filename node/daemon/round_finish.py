"""What follows a completed round, off the training thread: hashes, the local checkpoint, then the
hand-over to the daemon's loop (round record, commits, the published state).

On a GPU the next window's compute is the scarce thing. Hashing the global state (sha256 over
every parameter, twice: the round's hash and the published state's), and writing a checkpoint of
model, optimizer and state (~1.5 GB for the 124M-parameter preset, fsynced) took seconds per round
on the training thread (benchmarks/results/node_gpu.json). The training thread now only copies what
the next window will overwrite (a snapshot on the CPU) and hands it to one worker thread, which
does the rest in order while the next window trains.

Order is what keeps work safe: the worker is one FIFO thread, and a round's record, commits and
published state reach the loop only after its checkpoint is on disk. A commit the coordinator
acknowledges is therefore never ahead of the checkpoint a restarted node resumes from, as before.
At most one checkpoint snapshot waits beside the one being written (memory stays bounded; a slow
disk slows training rather than growing a queue). A failed write stops the node at the next
hand-over with the write's own error, and the round it belonged to is neither logged nor committed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from murmur.node.daemon.training import shared_state_hash
from murmur.protocol.wire import tensors_hash

# (record, commits, shared tensors, their digest): what the loop takes from a finished round.
HandOver = Callable[[dict[str, Any], list, list[tuple[str, torch.Tensor]], bytes], None]


class RoundFinisher:
    def __init__(self, save_checkpoint: Callable[[dict[str, Any]], None], hand_over: HandOver) -> None:
        self._save, self._hand_over = save_checkpoint, hand_over
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-finish")
        self._checkpoint_slot = threading.Semaphore(2)  # one being written, one waiting
        self._failed: BaseException | None = None

    def submit(
        self,
        record: dict[str, Any],
        commits: list,
        shared: list[tuple[str, torch.Tensor]],
        checkpoint: dict[str, Any] | None,
    ) -> None:
        """Finish a round (training thread). ``shared`` must be tensors nobody writes any more and
        ``checkpoint`` a `NodeTrainer.state_dict` (a CPU copy); raises the error of an earlier round's failed write."""
        self._raise_failure()
        if checkpoint is not None:
            self._checkpoint_slot.acquire()
        self._pool.submit(self._finish, record, commits, shared, checkpoint)

    def drain(self) -> None:
        """Wait until every round submitted so far is handed over (training thread). A lease
        request after a lost or dropped lease must come after the last windows' commits: the
        coordinator hands the shard back from its committed offset. Raises the error of a failed
        write."""
        self._pool.submit(lambda: None).result()  # one FIFO worker: everything before it is done
        self._raise_failure()

    def close(self, *, raise_failure: bool = True) -> None:
        """Wait for every submitted round (its checkpoint, then its hand-over); raise a failure
        unless the caller is already leaving with an error of its own."""
        self._pool.shutdown(wait=True)
        if raise_failure:
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failed is not None:
            err, self._failed = self._failed, None
            raise err

    def _finish(self, record, commits, shared, checkpoint) -> None:  # noqa: ANN001 - see submit
        try:
            if self._failed is not None:
                return  # a round after a failed write is not handed over either
            record["hash"] = shared_state_hash(shared)
            digest = tensors_hash(shared)
            if checkpoint is not None:
                self._save(checkpoint)
            self._hand_over(record, commits, shared, digest)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread
            self._failed = err
        finally:
            if checkpoint is not None:
                self._checkpoint_slot.release()
