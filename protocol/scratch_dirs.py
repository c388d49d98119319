"""Temporary folders named by the process that made them, so a later process removes those that a
SIGKILLed one left behind.

A process removes its own scratch folder when it stops; a SIGKILL gives it no chance, and under
churn (the normal case here) those folders pile up in /tmp: a stage peer's replica of its next
stage is gigabytes. Each folder's name carries its maker's pid (``PREFIX<pid>-<random>``); making a
new one first removes this user's folders of that prefix whose maker is no longer running. A pid
reused by another process keeps its folder until that one ends too: nothing is removed early.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def make_scratch_dir(prefix: str) -> Path:
    """A new folder ``PREFIX<pid>-<random>`` in the temp dir (mode 0700), after removing the ones
    of that prefix left by processes that are gone."""
    sweep_orphans(prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def sweep_orphans(prefix: str) -> list[Path]:
    """Remove this user's ``PREFIX<pid>-*`` folders whose pid no longer runs; the ones removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid_text = path.name[len(prefix):].partition("-")[0]
        if not pid_text.isdigit():
            continue
        with contextlib.suppress(OSError):
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            if not pid_running(int(pid_text)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def pid_running(pid: int) -> bool:
    """Whether a process holds this number now (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
