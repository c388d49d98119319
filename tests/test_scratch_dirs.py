"""Scratch folders a SIGKILLed process left behind are removed by the next one that makes one
(protocol/scratch_dirs.py): real processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from murmur.protocol.scratch_dirs import make_scratch_dir, sweep_orphans

MAKE = ("import sys; from murmur.protocol.scratch_dirs import make_scratch_dir; "
        "print(make_scratch_dir(sys.argv[1]), flush=True); sys.stdin.read()")


def test_a_killed_makers_folder_goes_and_a_live_ones_stays():
    prefix = f"murmur-test-scratch-{uuid.uuid4().hex[:8]}-"
    procs = [subprocess.Popen([sys.executable, "-c", MAKE, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        dead, live = procs
        dead_dir, live_dir = (p.stdout.readline().strip() for p in procs)
        assert os.path.isdir(dead_dir) and os.path.basename(dead_dir).startswith(f"{prefix}{dead.pid}-")
        (open(os.path.join(dead_dir, "replica.bin"), "wb")).close()
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        mine = make_scratch_dir(prefix)
        assert not os.path.exists(dead_dir) and os.path.isdir(live_dir) and mine.is_dir()
        assert sweep_orphans(prefix) == []  # the live maker's and this process's stay
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    assert [p.name for p in sweep_orphans(prefix)] == [os.path.basename(live_dir)]
    mine.rmdir()
