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
