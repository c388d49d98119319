"""How the daemon stops: one flag that the training thread polls and the loop's tasks wait on.

A stop is asked for on the loop thread only: by the signal handlers, by the coordinator session
(the run is finished) and by the training thread through ``loop.call_soon_threadsafe`` (its
schedule or --max-rounds is done). The training thread reads ``is_set()`` between steps; the
loop's tasks sleep with ``sleep()``, which wakes at once when the stop comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class StopSignal:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.reason = ""
        self._log = log
        self._seen_by_thread = threading.Event()
        self._seen_by_loop = asyncio.Event()  # binds to the running loop when first awaited
        self._hooks: list[Callable[[str], None]] = []

    def is_set(self) -> bool:
        return self._seen_by_thread.is_set()

    def on_request(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(reason)`` on every request from now on (a stop must cut a wait short)."""
        self._hooks.append(hook)

    def request(self, reason: str) -> None:
        """Stop: the first request names the reason and says what the node does next."""
        if not self.is_set():
            self.reason = reason
            self._log(f"stopping ({reason}): finishing the current step, then commit, release, leave")
        self._set()
        for hook in self._hooks:
            hook(reason)

    def settle(self, reason: str) -> None:
        """The run ended or failed with no stop asked for: stop quietly, keeping any reason given."""
        if not self.is_set():
            self.reason = self.reason or reason
        self._set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when a stop is asked for."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._seen_by_loop.wait(), seconds)

    async def stopped(self) -> None:
        """Return once a stop is asked for (on the loop)."""
        await self._seen_by_loop.wait()

    async def unless_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None once a stop comes first: ``work`` is then cancelled and its
        unwinding awaited, so what it started is closed again (a start-up step cut short). A step
        that finished all the same hands over its result, for the caller to close."""
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.stopped())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done() or not self.is_set():
            return await task
        task.cancel()
        try:
            return await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - cut short on purpose: the stop says why
            return None

    def wait(self, seconds: float) -> bool:
        """Sleep on a plain thread (the training thread), but wake at once when a stop is asked
        for; True if it came."""
        return self._seen_by_thread.wait(seconds)

    def _set(self) -> None:
        self._seen_by_thread.set()
        self._seen_by_loop.set()
