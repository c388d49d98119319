"""Helper tasks of the exchange (a chunk being decoded, a stream's reader) that may outlive their use.

A helper task that is no longer wanted is cancelled; if it already failed, or fails while it is
being cancelled (a gRPC read that completes as the cancellation arrives, then finds the RPC
finished), its exception is dropped on purpose, not left for asyncio to report as "Task exception
was never retrieved" when the task is collected: whoever needed its result has an answer already.
"""

from __future__ import annotations

import asyncio


def discard(task: asyncio.Future | None) -> None:
    """Cancel a helper task that is no longer wanted; if it already failed, its exception is
    dropped on purpose (whoever needed it has an answer), not reported as never retrieved."""
    if task is not None:
        task.cancel()
        task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
