"""A pipelined run driven by the coordinator, with real processes on loopback: the run config's
[pipeline] section names the model and the pipeline, the coordinator assigns the stages, stage-mates
sync their weights beside the compute, and when both peers of a stage are SIGKILLed the coordinator
moves a peer there, which takes the stage's replica, and the driver's microbatches go on with the
ledger's token count exact."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from _pipeline_helpers import (
    RUN_TIMEOUT,
    TOKENS_PER_MB,
    check_commits,
    coordinator,
    finish,
    ledger_tokens,
    records,
    start_driver,
    start_run_peer,
    stop_all,
    wait_until,
)

from murmur.node.testnet.procs import murmur_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Bottleneck moves are checked every 10 minutes here, so the one move the test sees is the refill
# of the emptied stage, which does not wait for the check (tests/test_stage_board.py covers both).
REBALANCE_S = 600.0
HEARTBEAT_TTL_S = 3.0
PIPELINE = [
    "pipeline.stages=2", f"pipeline.rebalance_every_s={REBALANCE_S}", "pipeline.replica_every_s=1.0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.microbatch_attempts=8",
    "pipeline.hop_timeout_s=20.0", "pipeline.sync_every_s=2.0", "optim.warmup_steps=0",
]
MICROBATCHES = 60
# How long stage 0's peers must report one state before they are stopped: two sync periods and
# two heartbeats (the coordinator's default interval of 1 s).
AGREED_FOR_S = 2 * 2.0 + 2 * 1.0


def wait_for(what: str, ok, timeout_s: float = RUN_TIMEOUT, every_s: float = 0.5):
    return wait_until(what, ok, timeout_s, every_s)  # each look is a `murmur admin` call: every 0.5 s


def committed(path) -> int:
    """Microbatches the driver's fsynced commit log holds."""
    ends = [r["end"] for r in records(path.read_text(), "commit")] if path.exists() else []
    return max(ends, default=0)


def test_stages_are_assigned_synced_and_refilled_after_their_peers_are_killed(tmp_path, byte_dataset):
    with coordinator(tmp_path, byte_dataset.root, joins=6, overrides=PIPELINE,
                     coordinator_args=["--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--restart-grace", "1"]) as (net, join):
        peers = []
        try:
            for i in range(5):
                peers.append(start_run_peer(tmp_path / f"peer{i}", join))
            # assigned in turn to the emptiest stage; a stage's later peers take its state from the first
            assert [p.ready["stage"] for p in peers] == [0, 1, 0, 1, 0]
            assert [p.ready["state_source"] for p in peers] == ["seed", "seed", "peers", "peers", "peers"]
            assert peers[2].ready["state_hash"] == peers[0].ready["state_hash"]

            def replicas():
                view = net.admin("stages", "--peers")
                return all(p["report"]["replica_stage"] == 1 for p in view["peers"] if p["report"]["stage"] == 0)

            # the replicas first (they refresh every second), so that the kill lands right after the
            # first commits and the driver still has most of its microbatches to send through the refill
            wait_for("stage 0's copies of stage 1", replicas)
            driver = start_driver(None, tmp_path, byte_dataset.root, "driver", "--microbatches", str(MICROBATCHES),
                                  "--concurrency", "2", join=join)
            log = tmp_path / "driver.commits"
            wait_for("the first commits", lambda: committed(log) >= 10, every_s=0.1)
            killed_at = time.time()
            for p in peers:
                if p.ready["stage"] == 1:
                    p.proc.send_signal(signal.SIGKILL)
                    p.proc.wait()
            out = finish(driver)

            # Idle now: the next sync round leaves stage 0's two peers with one state. The view's
            # reports are a heartbeat old, and the driver's last microbatches can all land within
            # one heartbeat (a CI run: 50 in 0.5 s): reports from before them still showed the one
            # state of the idle refill wait, and the peers were stopped before the round that
            # synced those microbatches. So the agreement must hold for two sync periods and two
            # heartbeats, long enough for both peers to have reported after that round.
            held = {"hash": None, "since": 0.0}

            def agreed():
                view = net.admin("stages", "--peers")
                hashes = {p["report"]["state_hash"] for p in view["peers"] if p["report"]["stage"] == 0}
                now = time.monotonic()
                if len(hashes) != 1 or hashes != {held["hash"]}:
                    held.update(hash=next(iter(hashes)) if len(hashes) == 1 else None, since=now)
                    return None
                return view if now - held["since"] >= AGREED_FOR_S else None

            # the move is the coordinator's, after the heartbeat TTL and a sweep: awaited, not assumed
            # done because the driver is
            events = wait_for("the emptied stage's refill",
                              lambda: net.admin("events", "--kind", "stage_move")["events"], timeout_s=60)
            view = wait_for("stage 0's peers to agree", agreed, timeout_s=60)
            table = subprocess.run(
                murmur_cmd("admin", "stages", "--coordinator", str(net.info["address"]), "--admin-key",
                           str(net.info["admin_key_file"])), capture_output=True, text=True, timeout=120,
            ).stdout
            serving = net.admin("events", "--kind", "stage_serving")["events"]
            tokens, _ = ledger_tokens(net)
        finally:
            stop_all(peers)
    assert driver.returncode == 0, out[-3000:]
    check_commits(records(out, "commit"), MICROBATCHES)
    assert tokens == MICROBATCHES * TOKENS_PER_MB  # no microbatch lost or counted twice
    # the coordinator moved one stage-0 peer to the emptied stage, which took its replica
    (move,) = events
    assert move["kind"] == "stage_move" and move["detail"]["reason"] == "empty stage", move
    moved = next(p for p in peers if p.node_id == move["node_id"])
    (stage,) = [r for r in moved.lines if r.get("event") == "stage" and r["from_stage"] >= 0]
    assert (stage["from_stage"], stage["stage"], stage["source"]) == (0, 1, "replica")
    assert moved.stopped["stage"] == 1 and moved.stopped["moves"] == 1
    assert sorted(p["report"]["stage"] for p in view["peers"]) == [0, 0, 1]
    header, row0, row1 = table.splitlines()[:3]  # the operator's table: stage, blocks, peers, ..., last move
    assert header.split()[:3] == ["STAGE", "BLOCKS", "PEERS"] and "LAST MOVE" in header, table
    assert row0.split()[:3] == ["0", "0-0", "2"] and row1.split()[:3] == ["1", "1-1", "1"], table
    assert "stage 0 -> 1 (empty stage)" in row1, table
    stage0 = [p for p in peers if p.stopped.get("stage") == 0]
    assert len(stage0) == 2 and all(p.stopped["sync_rounds"] > 0 for p in stage0), [p.stopped for p in stage0]
    sync = ["sync_rounds", "sync_idle_rounds", "sync_failed", "sync_adopted", "sync_last_round", "sync_last_error",
            "state_hash"]
    assert stage0[0].stopped["state_hash"] == stage0[1].stopped["state_hash"], \
        [{k: p.stopped.get(k) for k in sync} for p in stage0]
    done = records(out, "done")[0]
    assert done["committed_tokens"] == MICROBATCHES * TOKENS_PER_MB
    # the stage served again: the heartbeat TTL, a sweep, the move and a local replica's load
    (back,) = [e for e in serving if e["node_id"] == moved.node_id and e["at"] > killed_at]
    print(f"stage 1 served again {back['at'] - killed_at:.1f} s after its peers were killed")
