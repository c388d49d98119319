"""A stage peer or driver restarted with its state folder is the same member of the run: real
processes on loopback, SIGKILLed and started again with their ``--state-dir`` and no usable token.

The coordinator's heartbeat TTL and lease TTL are long here (a minute and two), so only the kept
identity can explain what is checked: a new node id would find the killed driver's shard held
and its stage listed twice until those TTLs ran out."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from _node_helpers import ledger
from _pipeline_helpers import PeerProc, coordinator, finish, records, start_driver, start_run_peer, stop_all, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOKENS_PER_MB = 4 * 64  # the tiny testnet config's seq_len, 4 rows a microbatch
PIPELINE = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=1.0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "pipeline.checkpoint_every_s=2.0", "train.batch_size=4", "train.eval_batches=2",
    "optim.warmup_steps=2", "train.eval_every=1000",
]
# Long TTLs: a dead member's lease and stage entry outlive the test unless its restart is itself.
SLOW_TTL = ["--heartbeat-ttl", "60", "--lease-ttl", "120", "--restart-grace", "1"]


def logged(path: Path) -> list[dict]:
    return records(path.read_text(), "commit") if path.exists() else []


def joins(net) -> list[str]:
    return [e["node_id"] for e in net.admin("events", "--run", net.run_id, "--kind", "join")["events"]]


def node_id_of(folder: Path) -> str:
    return json.loads((folder / "join.json").read_text())["node_id"]


def test_a_driver_killed_and_restarted_with_its_state_folder_keeps_its_lease_and_counts_nothing_twice(
    tmp_path, small_shards
):
    steps = 48  # over two shards (32 microbatches each)
    overrides = [*PIPELINE, f"train.steps={steps}"]
    state = tmp_path / "driver-state"
    # Exactly the joins of the first processes: the restart has only a used-up token to show.
    with coordinator(tmp_path, small_shards, joins=3, overrides=overrides, coordinator_args=SLOW_TTL) as (net, join):
        peers = []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            first = start_driver(None, tmp_path, small_shards, "first", "--state-dir", str(state), join=join)
            wait_until("the first driver's commits",
                     lambda: sum(c["end"] - c["start"] for c in logged(tmp_path / "first.commits")) >= 8)
            first.send_signal(signal.SIGKILL)
            first_out, _ = first.communicate(timeout=60)
            _, offsets, holders = ledger(net)
            me = node_id_of(state)
            assert records(first_out, "joined")[0] == {"event": "joined", "node_id": me, "run_id": net.run_id,
                                                       "rejoined": False}
            assert holders[0] == me  # the dead process's lease, far from expiry (lease TTL 120 s)
            t_restart = time.monotonic()
            second = start_driver(None, tmp_path, small_shards, "second", "--state-dir", str(state), join=join)
            out = finish(second)
            tokens, _, _ = ledger(net)
            joined = joins(net)
        finally:
            stop_all(peers)
    assert second.returncode == 0, out[-3000:]
    assert records(out, "joined")[0] == {"event": "joined", "node_id": me, "run_id": net.run_id, "rejoined": True}
    assert joined.count(me) == 1 and len(joined) == 3, joined  # no second join: the token was not needed
    (done,) = records(out, "done")
    assert done["reason"] == "schedule done", done
    # Its first ask got back the lease the killed process held: shard 0, from the ledger's offset,
    # at once (another node would have been given shard 1 and left shard 0 to the lease TTL).
    lease = records(out, "lease")[0]
    assert (lease["shard"], lease["start"]) == (0, offsets[0]) and offsets[0] > 0, (lease, offsets)
    first_commit = records(out, "commit")[0]
    assert first_commit["shard"] == 0, first_commit
    assert time.monotonic() - t_restart < 120  # within the test, far from the lease's expiry
    # The ledger holds the schedule, each token once: the first process's commits (those it logged,
    # and at most one it made but was killed before logging), then the second's from the offset.
    first_tokens = sum(c["tokens"] for c in logged(tmp_path / "first.commits"))
    assert tokens == steps * TOKENS_PER_MB, tokens
    assert done["committed_tokens"] == tokens - offsets[0], (done, offsets)
    assert 0 <= offsets[0] - first_tokens <= 2 * TOKENS_PER_MB, (offsets, first_tokens)


def restart_peer(folder: Path, address: str) -> PeerProc:
    """The stage peer of ``folder`` again, with its state folder and no token at all."""
    return start_run_peer(folder, (address, ""), "--state-dir", str(folder / "state"), "--progress-every", "0")


def test_a_stage_peer_killed_and_restarted_with_its_state_folder_is_the_same_node_listed_once(tmp_path, small_shards):
    overrides = [*PIPELINE, "train.steps=1000000"]
    with coordinator(tmp_path, small_shards, joins=3, overrides=overrides, coordinator_args=SLOW_TTL) as (net, join):
        peers, driver = [], None
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join, "--state-dir", str(tmp_path / f"peer{i}" / "state"),
                                    "--progress-every", "0") for i in range(2)]
            by_stage = {p.ready["stage"]: p for p in peers}
            assert sorted(by_stage) == [0, 1]
            victim = by_stage[1]
            folder = tmp_path / f"peer{peers.index(victim)}"
            driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
            wait_until("commits through both stages", lambda: len(logged(tmp_path / "driver.commits")) >= 3)
            wait_until("a checkpoint of stage 1", lambda: list((folder / "state" / "stage-checkpoints").glob("*.pt")))
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(60)
            back = restart_peer(folder, join[0])
            peers[peers.index(victim)] = back
            view = net.admin("stages", "--run", net.run_id)
            # Training goes on through the restarted peer.
            mark = len(logged(tmp_path / "driver.commits"))
            try:
                wait_until("commits after the restart", lambda: len(logged(tmp_path / "driver.commits")) >= mark + 3)
            except AssertionError as err:  # seen once in eight loaded runs: what the coordinator saw
                raise AssertionError(f"{err}; stages: {net.admin('stages', '--peers')}; events: "
                                     f"{net.admin('events', '--limit', '40')['events']}") from None
            joined = joins(net)
        finally:
            if driver is not None and driver.poll() is None:
                driver.send_signal(signal.SIGTERM)
            if driver is not None:
                finish(driver)
            stop_all(peers)
    assert back.node_id == victim.node_id
    assert back.ready["stage"] == 1 and back.ready["address"] != victim.ready["address"]
    assert back.ready["state_source"] in ("checkpoint", "replica", "kept"), back.ready  # not the seed's weights
    assert len(joined) == 3 and joined.count(victim.node_id) == 1, joined  # no token: no second join
    # Right after it served again, the coordinator lists it once, at its new address.
    listed = [p for p in view["peers"] if p["node_id"] == victim.node_id]
    assert len(listed) == 1, view["peers"]
    assert listed[0]["report"]["address"] == back.ready["address"], listed
    assert [s["peers"] for s in view["summary"]] == [1, 1], view["summary"]
    assert back.stopped, "the restarted peer did not stop cleanly"
