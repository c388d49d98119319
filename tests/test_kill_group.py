"""`kill_group` (node/testnet/procs.py) kills what a process left in its session, and never the
session of another process that got the same pid after it was reaped (pids wrap within minutes on a
busy machine: a test's stop once could SIGKILL another test's coordinator)."""

from __future__ import annotations

import subprocess

import psutil
import pytest

from murmur.node.testnet.procs import kill_group


def _session_of(cmd: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", cmd], start_new_session=True, stdout=subprocess.PIPE, text=True)


def test_a_reaped_process_whose_pid_is_someone_elses_now_leaves_that_session_alone():
    victim = _session_of("exec sleep 60")  # a live session leader: another test's coordinator, say
    gone = _session_of("exit 0")
    gone.wait()
    try:
        gone.pid = victim.pid  # as if its number had been handed out again to the victim
        kill_group(gone)
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL would have ended it by then
            victim.wait(timeout=2)
    finally:
        victim.kill()
        victim.wait()


def test_what_a_reaped_process_left_in_its_session_is_killed():
    leader = _session_of("sleep 60 & echo $!")
    orphan = psutil.Process(int(leader.stdout.readline()))
    leader.wait()
    leader.stdout.close()
    try:
        kill_group(leader)
        orphan.wait(timeout=30)  # raises psutil.TimeoutExpired if it lived on
    finally:
        if orphan.is_running():
            orphan.kill()
