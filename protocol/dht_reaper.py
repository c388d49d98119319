"""Kill a DHT's helper processes when the process that owns them dies, whatever the death.

hivemind runs its DHT in a forked child, and that child runs the ``p2pd`` daemon; neither dies
with their owner when the owner is SIGKILLed (checked: both keep running as orphans). Python
cannot arm PR_SET_PDEATHSIG for processes it did not exec, and we do not subclass hivemind's
process class, so protocol/dht.py starts this watcher (a plain ``subprocess``, no imports beyond
the standard library) right after the DHT is up:

    python -m murmur.protocol.dht_reaper OWNER_PID INTERVAL PID:START [PID:START ...]

It polls the owner; when the owner is gone it sends SIGTERM, then SIGKILL after a grace period,
to each listed pid whose start time still matches (so a reused pid is never hit), and exits. It
ignores SIGINT (Ctrl+C reaches the whole process group; the owner cleans up, the watcher stays
to check) and treats SIGTERM as "check now and exit", which is how the owner stops it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

GRACE_SECONDS = 2.0  # between SIGTERM and SIGKILL


def start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or fields[0] == "Z":  # a zombie is as good as gone
        return None
    return fields[19]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (scanning /proc: psutil is only a dev dependency)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def kill_all(targets: dict[int, str], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every target still alive (same start time), then SIGKILL what survives ``grace``."""
    alive = {pid: st for pid, st in targets.items() if start_time(pid) == st}
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while alive and time.monotonic() < end:
        time.sleep(0.05)
        alive = {pid: st for pid, st in alive.items() if start_time(pid) == st}
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    owner, interval = int(argv[0]), float(argv[1])
    targets = {int(p): s for p, s in (item.split(":", 1) for item in argv[2:])}
    owner_start = start_time(owner)
    stop = False

    def on_term(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
    while not stop and owner_start is not None and start_time(owner) == owner_start:
        if all(start_time(pid) != st for pid, st in targets.items()):
            return 0  # everything shut down normally
        time.sleep(interval)
    kill_all(targets)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
