"""Where a node's start went: the moments its start-up phases ended, for the line that says it started.

A restart's seconds are the volunteer's and the run's (the others train without it meanwhile), and
the phases overlap (the model is built and the checkpoint read while the DHT's process starts:
node/daemon/node.py), so the line gives when each ended, counted from the start of `Node.run`,
and the build's own length. benchmarks/restart.py reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class StartTimes:
    t0: float = field(default_factory=time.monotonic)
    joined: float | None = None  # the join (or rejoin) answered
    dataplane: float | None = None  # the peer server and DHT up (or the solo plane)
    prepare_s: float | None = None  # the trainer's build and the checkpoint's read (beside the data plane's start)
    restored: float | None = None  # the newest state taken: ready to train

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def line(self) -> str:
        """``started in 2.6 s (joined at 0.3, data plane at 1.6, model and checkpoint 0.4 s, state at 2.5)``."""
        parts = [f"{what} at {at:.1f}" for what, at in (("joined", self.joined), ("data plane", self.dataplane),
                                                        ("state", self.restored)) if at is not None]
        if self.prepare_s is not None:
            parts.insert(2, f"model and checkpoint {self.prepare_s:.1f} s")
        return f"started in {self.now():.1f} s ({', '.join(parts)})"
