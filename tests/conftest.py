"""Shared fixtures: a small real dataset, and a guard that no test leaves a process behind."""

from __future__ import annotations

import time

import psutil
import pytest


@pytest.fixture(autouse=True)
def no_leaked_children():
    """Fail a test that leaves a child process (a node, a coordinator, hivemind's p2pd) running."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 10.0
    while True:
        left = [p for p in me.children(recursive=True) if p.pid not in before and _alive(p) and not _fork_server(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        names = ", ".join(f"{p.pid}:{_name(p)}" for p in left)
        for p in left:
            p.kill()
        pytest.fail(f"test left child processes running: {names}")


def _fork_server(p: psutil.Process) -> bool:
    """The warm-start fork server (node/testnet/warm.py) and multiprocessing's resource tracker that
    comes with it: started by the first test that starts a testnet and kept for the session (both
    exit with this process). The processes forked from the server are still checked."""
    try:
        return "from multiprocessing." in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()[:3]) or p.name()
    except psutil.Error:
        return "?"


@pytest.fixture(scope="session")
def byte_dataset(tmp_path_factory):
    """The bundled Shakespeare, byte-tokenized into 64K-token shards (about 0.3 s)."""
    from murmur.node.model.data import Dataset, prepare

    root = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    prepare(root, tokenizer="byte", shard_tokens=1 << 16)
    return Dataset.open(root)
