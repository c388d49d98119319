"""The steps of the durability scenarios (issue 50), shared by their tests
(tests/test_durable_state.py, tests/test_pipeline_kept_restore.py) and the benchmark that times
them (benchmarks/durability.py): the test asserts on what each step returns, the benchmark
records how long it took. Real coordinator, node, stage peer and driver processes on loopback.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass
from pathlib import Path

from _node_helpers import (
    FAST_COORDINATOR,
    FAST_NODE,
    UNTIL_STOPPED,
    hashes_by_round,
    log,
    make_testnet,
    trained,
    wait_log,
    wait_rounds,
)
from _pipeline_helpers import (
    PeerProc,
    coordinator,
    finish,
    records,
    start_driver,
    start_run_peer,
    stop_all,
    wait_until,
)

from murmur.node.testnet.procs import Testnet, wait_for

# Every round evaluated (eval_every = inner_steps), so the kept round's val loss is on record.
RUN = [*UNTIL_STOPPED, "train.eval_every=5"]
RESTORED = r"restored the run's state of round (\d+) from the coordinator's kept copy \(hash (\w+)"


def events(net: Testnet, kind: str) -> list[dict]:
    return net.admin("events", "--run", net.run_id, "--kind", kind, "--limit", "1000")["events"]


def detail(event: dict) -> dict:
    import json

    d = event.get("detail", {})
    return json.loads(d) if isinstance(d, str) else d


def stamp(line: str) -> float | None:
    """The unix time of a log line that starts with its date and time (a node's, a stage peer's)."""
    m = re.match(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)", line)
    return dt.datetime.fromisoformat(m[1].replace(",", ".")).timestamp() if m else None


def first_at(text: str, pattern: str, since: int = 0) -> float | None:
    """When the first line past ``since`` characters matching ``pattern`` was written."""
    for line in text[since:].splitlines():
        at = stamp(line)
        if at is not None and re.search(pattern, line):
            return at
    return None


def seconds_between(text: str, first: str, then: str) -> float | None:
    """Seconds between the first line matching ``first`` and the first later line matching
    ``then``, from the log lines' time stamps (HH:MM:SS.mmm or HH:MM:SS)."""
    start = None
    for line in text.splitlines():
        t = re.search(r"(\d\d):(\d\d):(\d\d(?:\.\d+)?)", line)
        if t is None:
            continue
        at = int(t[1]) * 3600 + int(t[2]) * 60 + float(t[3])
        if start is None and re.search(first, line):
            start = at
        elif start is not None and re.search(then, line):
            return at - start
    return None


# --- data parallel: every node gone, the coordinator keeps the state ----------------------------

def kept_net(root: Path, data: Path) -> Testnet:
    net = make_testnet(root, data, overrides=[*RUN, "keep.every_s=2"], node_args=FAST_NODE)
    net.coordinator_args = list(FAST_COORDINATOR)
    return net


def train_then_all_gone(net: Testnet) -> tuple[list, int]:
    """Two nodes train, the keeper keeps a state, one is SIGKILLed and the other SIGTERMed (the
    coordinator pulls its newer state before it answers its leave). The nodes and the newest
    round they trained."""
    net.start_coordinator()
    net.create_run(token_uses=8)
    a, b = [net.add_node(extra=["--min-peers", "2"]) for _ in range(2)]
    for node in (a, b):
        wait_rounds(node, 3)
    wait_for(lambda: bool(events(net, "state_kept")), 60, what="a state_kept event")
    net.kill_node(a)
    assert net.stop_node(b) == 0, log(b)[-2000:]
    return [a, b], max(hashes_by_round([a, b]))


@dataclass
class Restored:
    node: object
    round: int  # the round it restored
    hash_prefix: str  # of the state it restored, as its line names it
    restore_s: float  # from its start to the restored state
    first_round_s: float  # from its start to its first round trained


def join_and_restore(net: Testnet) -> Restored:
    """A node with a fresh folder joins the run no node serves: it restores the kept state and trains."""
    started = time.time()
    c = net.add_node()
    m = wait_log(c, RESTORED)
    wait_rounds(c, 1)
    return Restored(c, int(m[1]), m[2], round(first_at(log(c), r"kept copy") - started, 2),
                    round(min(float(r["time"]) for r in trained(c)) - started, 2))


# --- data parallel: nothing kept anywhere ---------------------------------------------------------

def lost_net(root: Path, data: Path) -> Testnet:
    net = make_testnet(root, data, overrides=[*RUN, "keep.every_s=0"],
                       node_args=[*FAST_NODE, "--state-fetch-timeout", "3"])
    net.coordinator_args = list(FAST_COORDINATOR)
    return net


def train_alone_then_lost(net: Testnet):
    """One node trains and stops, nothing kept; a node with a fresh folder joins and the run waits
    for its operator (a state_lost event). (the waiting node, the stopped node's newest round,
    seconds from the join to the wait)"""
    net.start_coordinator()
    net.create_run(token_uses=8)
    a = net.add_node()
    wait_rounds(a, 3)
    assert net.stop_node(a) == 0, log(a)[-2000:]
    newest = max(r["round"] for r in trained(a))
    started = time.time()
    b = net.add_node()  # a fresh folder: no state at all
    wait_for(lambda: bool(events(net, "state_lost")), 180, what="a state_lost event")
    return b, newest, round(time.time() - started, 2)


def recover(net: Testnet, node, start_from: str = "scratch") -> float:
    """The operator's `admin runs recover`; seconds from it to the node's first round."""
    assert net.admin("runs", "recover", net.run_id, "--from", start_from)["run_id"] == net.run_id
    decided = time.time()
    wait_rounds(node, 1)
    return round(min(float(r["time"]) for r in trained(node)) - decided, 2)


# --- the DHT after a coordinator restart --------------------------------------------------------

def dht_net(root: Path, data: Path) -> Testnet:
    net = make_testnet(root, data, overrides=RUN, node_args=FAST_NODE)
    net.coordinator_args = list(FAST_COORDINATOR)
    return net


# A node restarted after a coordinator restart meets its peers within this (the test's bound on
# a loaded machine), and would wait for them far longer (its --peers-wait): the wait ends by meeting them.
PEERS_MET_S = 180.0
PEERS_WAIT_S = 3 * PEERS_MET_S


def restart_coordinator_then_a_node(net: Testnet):
    """Three nodes train; the coordinator is SIGKILLed and restarted, the survivors dial its DHT
    peer again; then one node is SIGKILLed and restarted with --min-peers 3 and a wait for them far
    longer than the step's own (so it ends by meeting them, not by running out). (that node, its
    log since the restart, how many peers it met, seconds from its data plane to meeting them)"""
    net.start_coordinator()
    net.create_run(token_uses=8)
    nodes = [net.add_node(extra=["--min-peers", "3"]) for _ in range(3)]
    for node in nodes:
        wait_rounds(node, 2)
    marks = [len(log(n)) for n in nodes]
    address = str(net.info["address"])
    net.kill_coordinator()
    net.stop_coordinator()
    net.start_coordinator(address)
    for node, mark in zip(nodes[:2], marks, strict=False):
        wait_log(node, r"dialed its DHT peer again \([1-9]\d* of", since=mark, timeout_s=120)
    late = nodes[2]
    net.kill_node(late)
    since = len(log(late))
    net.start_node(late, ["--min-peers", "3", "--peers-wait", str(PEERS_WAIT_S)])
    m = wait_log(late, r"(\d+) peer\(s\) announced \(waited for 3\)", since=since, timeout_s=PEERS_MET_S)
    text = log(late)[since:]
    met = seconds_between(text, r"data plane|DHT started|peer server", r"peer\(s\) announced \(waited for 3\)")
    return late, since, int(m[1]), met


# --- pipelined: every stage peer gone, the coordinator keeps the stages ------------------------

STEPS = 16  # the pipelined run's schedule
PIPELINE_KEEP = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "pipeline.activation_codec=\"fp32\"", "train.batch_size=4", "train.eval_batches=2",
    "optim.warmup_steps=2", f"train.steps={STEPS}", f"train.eval_every={STEPS}",
    # One pull on the clock (the first, once every stage is served); the newest is kept when the
    # driver releases its lease at the schedule's end.
    "keep.every_s=600", "keep.lease_pull_every_s=0.2",
]
PIPELINE_COORDINATOR = ["--heartbeat-ttl", "3", "--restart-grace", "1"]
KEPT_STAGE = r"stage (\d+): restored from the coordinator's kept set of run step (\d+) \(hash (\w+)\)"


def pipeline_net(tmp: Path, data: Path, overrides: list[str] = PIPELINE_KEEP, joins: int = 8):
    """A coordinator with a pipelined run: a context manager of (testnet, (address, token))."""
    return coordinator(tmp, data, joins=joins, overrides=overrides, coordinator_args=PIPELINE_COORDINATOR)


def pipeline_trained_then_gone(net: Testnet, join, tmp: Path, data: Path, peers: list[PeerProc],
                               between=None, kept: bool = True) -> tuple[float, list[dict]]:
    """Two stage peers (appended to ``peers``) serve while a driver runs the schedule, then every
    stage peer stops and leaves the coordinator's view. ``between(peers)`` runs once they serve,
    before the driver. (the driver's last val loss, the state_kept events of the schedule's last
    step, awaited before the peers stop when ``kept``)"""
    peers += [start_run_peer(tmp / f"peer{i}", join) for i in range(2)]
    if between is not None:
        between(peers)
    driver = start_driver(None, tmp, data, "driver", join=join)
    out = finish(driver)
    assert driver.returncode == 0, out[-3000:]
    (val,) = [v["val_loss"] for v in records(out, "val") if v["step"] == STEPS]
    last = []
    if kept:
        last = wait_until("the stages kept at the schedule's end", lambda: [
            e for e in events(net, "state_kept") if detail(e)["round"] == STEPS], timeout_s=60)
    stop_all(peers)
    assert all(p.stopped for p in peers), [p.lines[-3:] for p in peers]
    wait_until("the stage peers gone from the coordinator's view",
               lambda: not net.admin("stages", "--run", net.run_id)["peers"], timeout_s=60)
    return val, last


@dataclass
class StageRestored:
    peer: PeerProc
    restore_s: float  # from its start to its stage restored from the kept set
    ready_s: float  # from its start to serving


def join_stage_peer(tmp: Path, join, name: str) -> StageRestored:
    """A stage peer with a fresh folder joins; it restores its stage from the kept set."""
    started = time.time()
    p = start_run_peer(tmp / name, join)
    ready_s = time.time() - started
    text = (tmp / f"{name}.log").read_text()
    at = first_at(text, KEPT_STAGE)
    return StageRestored(p, round(at - started, 2) if at is not None else -1.0, round(ready_s, 2))
