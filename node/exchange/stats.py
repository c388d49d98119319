"""CPU seconds the exchange spends in its worker threads, by phase (benchmarks, diagnosis).

Phases: ``encode`` (our input chunks to the owners), ``own`` (our input to the span we own),
``decode_input`` (members' chunks at the owner), ``reduce`` (aggregate, re-encode, decode a chunk),
``decode_result`` (the owners' reduced chunks). Thread CPU time, so a wait for the GIL or for a
core is not counted; torch's own intra-op threads are not either (set torch to one thread to see
everything). Whatever the process used beyond these is the transport: TLS, HTTP/2, protobuf,
copies and the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class PhaseTimes:
    def __init__(self) -> None:
        self._cpu: Counter[str] = Counter()
        self._lock = threading.Lock()

    def wrap(self, phase: str, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, counting the CPU time of the thread that runs it under ``phase``."""

        def run(*args, **kwargs) -> T:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                with self._lock:
                    self._cpu[phase] += dt

        return run

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._cpu)


class Timeline:
    """Wall-clock events of the exchange (diagnosis, benchmarks): ``(time.time(), event, fields)``.

    Off by default (``mark`` is then one attribute test). Events: ``call``/``attempt``/
    ``complete``/``hashed`` of a reduce; per chunk j, with the peer on the other side:
    ``in_w0``/``in_w1`` (our input chunk handed to gRPC / accepted by it, to owner ``peer``),
    ``res_rx`` (a reduced chunk arrived from owner ``peer``), ``rx`` (member ``peer``'s input chunk
    arrived at this owner), ``red`` (this owner reduced chunk j), ``out_w0``/``out_w1`` (the reduced
    chunk handed to / accepted by gRPC for member ``peer``)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.events: list[tuple[float, str, dict]] = []

    def mark(self, event: str, **fields: object) -> None:
        if self.enabled:
            self.events.append((time.time(), event, fields))

    def take(self) -> list[tuple[float, str, dict]]:
        out, self.events = self.events, []
        return out
