"""Shared fixtures: a small real dataset, and a guard that no test leaves a process behind; the test
tiers (pyproject.toml's markers): a test not marked `integration` or `system` is a `unit` test."""

from __future__ import annotations

import os
import time

import psutil
import pytest

TIERS = ("system", "integration", "unit")
# The longest files first, so that two xdist workers (`make test`) do not end on one of them alone,
# and the compose test last: its image build and clean-up load the machine for minutes, and a
# churn file that ran on a worker right after it once lost every DHT start to its 30 s timeout.
FIRST = ("test_hetero_nodes.py", "test_churn_catchup.py", "test_churn_chaos.py", "test_churn_restart.py",
         "test_poisoning.py", "test_node_lifecycle.py")
LAST = ("test_compose.py",)


def pytest_collection_modifyitems(config, items):
    """Mark every test of no tier a unit test (`make test-quick` runs those), and order the
    collection: FIRST, then system, integration, unit, then LAST, the same on every xdist worker."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS[:2]):
            item.add_marker(pytest.mark.unit)

    def rank(item) -> tuple[bool, int, int]:
        tier = next(i for i, t in enumerate(TIERS) if item.get_closest_marker(t))
        name = item.path.name
        return (name in LAST, FIRST.index(name) if name in FIRST else len(FIRST), tier)

    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With MURMUR_REQUIRE_SYSTEM=1 (.ci/run sets it where it installed the engine, Chromium and the
    namespace tools) a system test that skips fails instead: a broken compose path must not land
    under a green CI run that merely skipped it."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("MURMUR_REQUIRE_SYSTEM") == "1" and item.get_closest_marker("system"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"a system test skipped where MURMUR_REQUIRE_SYSTEM=1 requires it: {reason}"


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


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    """The bundled corpus in shards of 32 microbatches of the pipeline tests (tests/_pipeline_helpers.py)."""
    from _pipeline_helpers import SMALL_SHARD_TOKENS

    from murmur.node.model.data import prepare

    root = tmp_path_factory.mktemp("data") / "shakespeare-byte-8k"
    prepare(root, tokenizer="byte", shard_tokens=SMALL_SHARD_TOKENS)
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny-model tests (`pytest.mark.usefixtures`): their ops are
    too small to split, and on a loaded 2-core machine two threads wait on each other most of the
    time (tests/test_generate.py took 10x longer with two)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
