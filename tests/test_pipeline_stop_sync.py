"""The last sync round at a clean stop (node/pipeline/stop_sync.py), with real processes on
loopback: two peers of a stage that trained different microbatches since their last round, stopped
together with SIGTERM, average their stage once more before their final checkpoints, which then
hold one state; a peer alone in its stage runs no such round."""

from __future__ import annotations

import pytest
from _pipeline_helpers import (
    coordinator,
    finish,
    records,
    start_driver,
    start_run_peer,
    stop_all,
    wait_until,
)

from murmur.node.pipeline import stage_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MICROBATCHES = 24
PIPELINE = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=0.0",
    "pipeline.target_samples=4", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "optim.warmup_steps=0",
    # No round during the test: without the last round the mates keep what each trained, which
    # differs (the router spreads the microbatches over both). No multiple of the samples is
    # passed, and the ledger is never still for an hour.
    "pipeline.sync_every_s=3600.0", "pipeline.sync_every_samples=1000000",
    "pipeline.checkpoint_every_s=0.0", "pipeline.stop_sync_s=30.0",
    # the shipped pipelined configs' outer step: the mates' plain average
    "sync.outer_lr=1.0", "sync.outer_momentum=0.0",
]


def test_stage_mates_stopped_together_sync_once_more_and_checkpoint_one_state(tmp_path, byte_dataset):
    with coordinator(tmp_path, byte_dataset.root, joins=4, overrides=PIPELINE) as (net, join):
        peers = []
        try:
            for i in range(3):  # stages 0, 1, 0: two peers of stage 0, one of stage 1
                peers.append(start_run_peer(tmp_path / f"peer{i}", join, "--state-dir", str(tmp_path / f"peer{i}")))
            assert [p.ready["stage"] for p in peers] == [0, 1, 0]
            driver = start_driver(None, tmp_path, byte_dataset.root, "driver", "--microbatches", str(MICROBATCHES),
                                  "--concurrency", "2", join=join)
            out = finish(driver)
            assert driver.returncode == 0, out[-3000:]

            def stage0_hashes():
                view = net.admin("stages", "--peers")
                got = {p["node_id"]: p["report"] for p in view["peers"] if p["report"]["stage"] == 0}
                # each has stepped since it joined and reported it (a heartbeat a second)
                return got if len(got) == 2 and all(r.get("optimizer_steps") for r in got.values()) else None

            before = wait_until("both stage-0 peers' reports after their steps", stage0_hashes)
        finally:
            stop_all(peers)  # SIGTERM to all three at once
    mates = [p for p in peers if p.ready["stage"] == 0]
    lone = next(p for p in peers if p.ready["stage"] == 1)
    for p in peers:
        assert p.proc.returncode == 0 and p.stopped, p.lines[-3:]
    assert all(p.stopped["samples_total"] > 0 for p in mates), [p.stopped["samples_total"] for p in mates]
    # They trained apart: the states they served before the stop differed.
    assert len({r["state_hash"] for r in before.values()}) == 2, before
    fields = ["final_sync_members", "final_sync_completed", "final_sync_error", "final_sync_seconds",
              "sync_rounds", "state_hash"]
    for p in mates:
        assert p.stopped["final_sync_members"] == 2 and p.stopped["final_sync_completed"], \
            [{k: m.stopped.get(k) for k in fields} for m in mates]
    assert mates[0].stopped["state_hash"] == mates[1].stopped["state_hash"]
    assert mates[0].stopped["state_hash"] not in {r["state_hash"] for r in before.values()}  # the average
    # Their final checkpoints hold that one state.
    hashes = []
    for p in mates:
        c = stage_checkpoint.newest(tmp_path / f"peer{peers.index(p)}", 0)
        state = stage_checkpoint.read(c.path)
        hashes.append(stage_checkpoint.params_hash(state["params"]))
    assert hashes == [mates[0].stopped["state_hash"]] * 2
    # The peer alone in its stage met nobody.
    assert lone.stopped["final_sync_members"] == 0 and not lone.stopped["final_sync_error"]
    assert records(out, "done")[0]["committed_tokens"] > 0
