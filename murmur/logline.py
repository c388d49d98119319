"""The lines a long-running murmur process logs (`murmur node run`): each with the time it was
written, as text (``2026-12-05T06:50:56.123+00:00 joined run ...``) or, with ``--log-format json``,
one JSON object per line (``{"time": ..., "at": <unix seconds>, "msg": ...}``) for log shippers.
Light on purpose (the standard library only): the command's flags are declared with it.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

FORMATS = ("text", "json")


def line_writer(fmt: str = "text", stream: TextIO | None = None) -> Callable[[str], None]:
    """A function that writes one message as one stamped line and flushes it."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use {' or '.join(FORMATS)}")

    def write(msg: str) -> None:
        now = time.time()
        stamp = dt.datetime.fromtimestamp(now).astimezone().isoformat(timespec="milliseconds")
        out = stream or sys.stdout
        for part in msg.splitlines() or [""]:
            if fmt == "json":
                out.write(json.dumps({"time": stamp, "at": round(now, 3), "msg": part}) + "\n")
            else:
                out.write(f"{stamp} {part}\n")
        out.flush()

    return write
