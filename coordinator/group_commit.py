"""Group commit: member calls that write the ledger together share one transaction, so one fsync.

A transaction is acknowledged only once its WAL frames are fsynced (store.py), and an fsync costs
milliseconds (4 ms at the median on the shared build machine, 58 ms at p99). 10,000 nodes
committing every 10 s are 1,000 transactions a second: one fsync each is more time than a second
has, and every other call waits behind them on the one loop.

So a Commit (and a Join, and a lease grant: a join storm is thousands of each) does not open its
own transaction: it joins a batch. The first call of a batch starts the flusher on the loop's next
turn; every call that arrives before it (the same turn's) joins. The flusher runs each call's rules
in order inside one transaction, each in a savepoint of its own (a refused commit takes back only
its own writes: Store.write), commits, fsyncs the WAL in a worker thread (Store.sync) and only then
answers them all. While that fsync runs the loop goes on: it takes new calls, which queue for the
next batch, and the flusher takes them all as soon as the fsync is done. Under light load a batch
is one call and nothing waits; under heavy load batches grow by themselves, with no timer to tune.

The fsync is off the loop because the loop is what takes calls in: gRPC's aio server takes one new
call a turn of the loop, so an fsync on the loop thread (inside SQLite's COMMIT, as before) stopped
new calls from arriving while it ran, and a join storm's batches stayed one call each, one fsync a
join (measured: 3,721 batches for 4,000 joins and lease grants of 2,000 nodes).

A call whose client gave up while it queued (its deadline, a cancel) is left out of the batch:
nothing of it is written, and its client, which has no answer, retries. Its ``fn`` must not run
anyway: gRPC frees an ended call, and what ``fn`` would read of it (the caller's certificate) is
gone; the service reads that before it queues (coordinator/service.py, ``_member_run``).

The promise is unchanged: a reply means the ledger has it on disk. A crash before the batch's
fsync loses at most the batch, and none of its callers has an answer (each retries: a repeated
commit answers ``duplicate``, leases.py), so the ledger stays exact. A failed COMMIT or fsync
(disk full, I/O error) fails every call of the batch with the same error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from .store import Store

T = TypeVar("T")


class GroupCommit:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self.batches = 0  # flushes done, and calls answered through them: the mean batch size
        self.calls = 0
        self._flusher: asyncio.Task[None] | None = None

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` inside the next batch's transaction; its result once the batch is on disk."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.append((fn, future))
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush_all())
        return await future

    async def _flush_all(self) -> None:
        """Batch after batch while calls keep coming (those that queued during an fsync are the
        next batch); then the flusher ends and the next call starts a new one."""
        try:
            while self._queue:
                await self._flush()
        finally:
            self._flusher = None

    async def _flush(self) -> None:
        batch, self._queue = self._queue, []
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        try:
            with self.store.write(durable=False):
                for fn, future in batch:
                    if future.done():  # its caller gave up (cancelled) before the batch: nothing of it runs
                        continue
                    try:
                        outcomes.append((future, fn(), None))
                    except Exception as err:  # noqa: BLE001 - the caller's own refusal, answered to it alone
                        outcomes.append((future, None, err))
            # The loop takes the next batch's calls meanwhile; nobody of this one is answered yet.
            await asyncio.to_thread(self.store.sync)
        except Exception as err:  # noqa: BLE001 - the COMMIT or fsync failed: nothing of the batch is promised
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        self.batches += 1
        self.calls += len(outcomes)
        for future, result, error in outcomes:
            if future.done():  # its caller gave up (cancelled): what it did is on disk all the same
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
