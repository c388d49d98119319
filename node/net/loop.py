"""The process's one asyncio loop, in a thread of its own, for callers that live in other threads.

One loop per process owns all networking (gRPC servers and clients, the DHT handle);
the training thread hands it coroutines and gets ``concurrent.futures.Future`` back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

LOOP_STOP_TIMEOUT = 10.0  # seconds to wait for the loop thread to finish its shutdown


def next_due(due: float, interval: float) -> float:
    """When a task repeated every ``interval`` seconds runs next (monotonic clock), given when it
    was last due. A fixed cadence: sleeping ``interval`` after each run instead stretches every
    period by the run's own latency, past a TTL counted in intervals (heartbeats renew leases).
    After a stall longer than the interval, the next run is now, not a burst to catch up."""
    return max(due + interval, time.monotonic())


class LoopThread:
    def __init__(self, name: str = "murmur-net") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Finish what was cancelled so gRPC objects close cleanly.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(LOOP_STOP_TIMEOUT)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RunningLoop:
    """A `LoopHandle` on a loop that already runs (the daemon's, a stage peer's): callers in
    other threads hand it coroutines and get ``concurrent.futures.Future`` back."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)
