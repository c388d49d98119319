"""How long training waits for the exchange: `WaitMeter` wraps the run's exchange, so a window's
compute time is its wall time less these waits, and a stop fails every pending call at once."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from murmur.optim.exchange import Exchange, ExchangeError


class _MeteredFuture(Future):
    """A future that adds the time its caller spends blocked in ``result()`` to a meter."""

    def __init__(self, meter: WaitMeter) -> None:
        super().__init__()
        self._meter = meter

    def result(self, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._meter.waited_s += time.perf_counter() - t0


class WaitMeter(Exchange):
    """Wraps the run's exchange and measures how long training waits for it: compute time is a
    step's time minus this (the algorithms wait inside their hooks, DeMo inside its optimizer)."""

    def __init__(self, inner: Exchange | None) -> None:
        # None until the node's data plane is open: its trainer is built while that starts
        # (`NodeTrainer.attach`), and nothing is exchanged before.
        self.inner = inner
        self.waited_s = 0.0
        self._pending: set[Future] = set()
        self._aborted = ""

    def abort(self, reason: str) -> None:
        """Fail every pending and later call at once (a stop must not sit out a round timeout)."""
        self._aborted = reason
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(ExchangeError(reason))

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def _wrap(self, fut: Future) -> Future:
        out = _MeteredFuture(self)
        if self._aborted:
            out.set_exception(ExchangeError(self._aborted))
            return out
        self._pending.add(out)

        def done(f: Future) -> None:
            self._pending.discard(out)
            if out.done():  # aborted meanwhile
                return
            err = f.exception() if not f.cancelled() else ExchangeError("the exchange call was cancelled")
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(f.result())

        fut.add_done_callback(done)
        return out

    def all_reduce(self, tensors, *, round_id: int, key: str = "", weight: float = 1.0):  # noqa: ANN001
        return self._wrap(self.inner.all_reduce(tensors, round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire, *, round_id: int, key: str = ""):  # noqa: ANN001
        return self._wrap(self.inner.all_gather(wire, round_id=round_id, key=key))

    def close(self) -> None:
        self.inner.close()
