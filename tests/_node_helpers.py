"""Helpers of the node tests: a small dataset, a testnet in a temporary folder, ledger readers."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from murmur.node.daemon.state_dir import read_rounds
from murmur.node.testnet.procs import Testnet, TestnetError, wait_for

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "testnet-tiny.toml"
ROUND_WAIT_S = 90.0  # a few rounds of the tiny model, on a loaded 2-core machine
# For tests that stop their nodes themselves: the tiny config's 200 steps end in ~2 s on a fast
# machine (a solo node's rounds took 30 ms in CI), before a restart or an outage is over.
UNTIL_STOPPED = ["train.steps=100000"]


def small_dataset(root: Path) -> Path:
    """The bundled Shakespeare in 8K-token shards: a node moves to a new shard every few rounds."""
    from murmur.node.model.data import prepare

    path = root / "data"
    if not (path / "manifest.json").is_file():
        prepare(path, tokenizer="byte", shard_tokens=8192)
    return path


def make_testnet(tmp: Path, data: Path, *, overrides: list[str] = (), node_args: list[str] = ()) -> Testnet:
    from murmur.protocol.runconfig import load_config

    cfg = load_config(TINY, [f'data.path="{data}"', *overrides])
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "run.toml"
    config.write_text(cfg.to_toml())
    return Testnet(root=tmp, config_path=config, data=data, threads=1, node_args=list(node_args))


def trained(node) -> list[dict]:
    return [r for r in read_rounds(node.state_dir) if "loss" in r]


def hashes_by_round(nodes) -> dict[int, dict[str, str]]:
    """round -> {node name: the state hash it recorded after that round}."""
    out: dict[int, dict[str, str]] = {}
    for node in nodes:
        for r in trained(node):
            out.setdefault(r["round"], {})[node.name] = r["hash"]
    return out


def wait_rounds(node, n: int, timeout_s: float = ROUND_WAIT_S) -> None:
    def ok() -> bool:
        if node.proc is not None and node.proc.poll() is not None:
            raise AssertionError(f"{node.name} exited with {node.proc.returncode}: {log(node)[-2000:]}")
        return len(trained(node)) >= n

    _waiting(node, ok, timeout_s, f"{node.name} to finish {n} rounds")


def wait_log(node, pattern: str, timeout_s: float = ROUND_WAIT_S, since: int = 0) -> re.Match:
    """The first match of ``pattern`` in the node's log past its first ``since`` characters
    (``len(log(node))`` before a restart: what this incarnation wrote), once there is one."""
    found: list[re.Match] = []

    def ok() -> bool:
        m = re.search(pattern, log(node)[since:])
        if m:
            found.append(m)
        return bool(m)

    _waiting(node, ok, timeout_s, f"{pattern!r} in {node.name}'s log")
    return found[0]


def _waiting(node, ok, timeout_s: float, what: str) -> None:
    """`wait_for`, and on a timeout the tail of the node's log in the failure: a slow CI machine's
    failure must say what the node was doing, since its temporary folder is gone by then."""
    try:
        wait_for(ok, timeout_s, what=what)
    except TestnetError as err:
        raise AssertionError(f"{err}; the end of {node.name}'s log:\n{log(node)[-3000:]}") from None


def log(node) -> str:
    try:
        return node.log_path.read_text(errors="replace")
    except OSError:
        return ""


def ledger(net: Testnet) -> tuple[int, dict[int, int], dict[int, str]]:
    """(tokens committed in the run, shard -> committed offset, shard -> holder)."""
    status = net.admin("status", "--run", net.run_id)
    shards = net.admin("shards", "list", "--run", net.run_id)["shards"]
    offsets = {int(s["shard_id"]): int(s["committed_offset"]) for s in shards}
    holders = {int(s["shard_id"]): s.get("holder", "") for s in shards}
    return int(status["run"]["tokens_committed"]), offsets, holders


def cleanup(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


# A churned network: the coordinator is the DHT bootstrap peer, and timeouts are short enough for a
# dead peer to be noticed within a test (tests/test_churn_restart.py, tests/test_churn_catchup.py).
FAST_COORDINATOR = ["--dht", "--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--round-timeout", "60", "--dht-record-ttl", "6"]


@contextlib.contextmanager
def churn_net(tmp: Path, data: Path, token_uses: int):
    """A running coordinator (the DHT bootstrap peer) with a run, fast timeouts, no node yet."""
    net = make_testnet(tmp, data, overrides=UNTIL_STOPPED, node_args=FAST_NODE)
    net.coordinator_args = list(FAST_COORDINATOR)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=token_uses)
        yield net
