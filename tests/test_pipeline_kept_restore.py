"""A pipelined run outlives its stage peers (issue 50): the coordinator keeps the newest complete
set of stage states, pulled when the driver's lease ends, and new stage peers with fresh folders,
joining after every stage peer left, restore their stages from it (same hashes), so the model
through them scores the driver's last validation loss, not a fresh model's. Real coordinator,
stage peer and driver processes on loopback, real signals."""

from __future__ import annotations

import asyncio

import pytest
from _pipeline_helpers import (
    PeerProc,
    coordinator,
    finish,
    records,
    start_driver,
    start_logged,
    start_run_peer,
    stop_all,
    wait_until,
    watcher_identity,
)
from test_pipeline_run import FAST_COORDINATOR

from murmur.coordinator import kept_state
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.pipeline.client import StageClient
from murmur.node.pipeline.driver import Driver
from murmur.node.pipeline.router import Router, StageEndpoint
from murmur.protocol.runconfig import PipelineSection

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
STEPS = 16
KEEP = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "pipeline.activation_codec=\"fp32\"", "train.batch_size=4", "train.eval_batches=2",
    "optim.warmup_steps=2", f"train.steps={STEPS}", f"train.eval_every={STEPS}",
    # One pull on the clock (the first, once every stage is served); the newest is kept when the
    # driver releases its lease at the schedule's end.
    "keep.every_s=600", "keep.lease_pull_every_s=0.2",
]


def val_through(join, run_id: str, peers, batches) -> float:
    """The validation loss through the stage peers now, as the driver evaluates it (fp32 activations)."""
    ident = watcher_identity(join)

    async def run() -> float:
        client = StageClient(ident, run_id=run_id)
        cfg = PipelineSection(stages=2, activation_codec="fp32", hop_timeout_s=60.0)
        router = Router(cfg)
        for s in (0, 1):
            router.set_peers(s, [StageEndpoint(p.node_id, p.ready["address"], s) for p in peers
                                 if p.ready["stage"] == s])
        try:
            driver = Driver(client, router, cfg, dim=64)
            losses = [await driver.evaluate(f"v{k}", x, y) for k, (x, y) in enumerate(batches)]
        finally:
            await client.aclose()
        return sum(losses) / len(losses)

    return asyncio.run(run())


def test_new_stage_peers_restore_the_kept_stages_after_every_stage_peer_left(tmp_path, small_shards):
    batches = eval_batches(Dataset.open(small_shards), 4, 64, 2)  # the driver's validation set
    with coordinator(tmp_path, small_shards, joins=8, overrides=KEEP, coordinator_args=FAST_COORDINATOR) as (net, join):
        peers, new = [], []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            fresh = val_through(join, net.run_id, peers, batches)
            driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
            out = finish(driver)
            assert driver.returncode == 0, out[-3000:]
            (val,) = [v["val_loss"] for v in records(out, "val") if v["step"] == STEPS]

            def kept_at_the_end():
                events = net.admin("events", "--run", net.run_id, "--kind", "state_kept", "--limit", "100")["events"]
                return [e for e in events if e["detail"]["round"] == STEPS]

            (kept_event,) = wait_until("the stages kept at the schedule's end", kept_at_the_end, timeout_s=60)
            assert kept_event["detail"]["reason"] == "lease_end", kept_event  # the lease's end, not the clock
            stop_all(peers)  # every stage peer stops
            assert all(p.stopped for p in peers), [p.lines[-3:] for p in peers]
            # ... and is gone from the coordinator's view (lost after the heartbeat TTL)
            wait_until("the stage peers gone from the view",
                       lambda: not net.admin("stages", "--run", net.run_id)["peers"], timeout_s=60)
            final = {p.stopped["stage"]: p.stopped["state_hash"] for p in peers}
            kept = kept_state.newest(net.db, net.run_id)
            assert kept is not None and kept.kind == "stages" and kept.round == STEPS, kept
            kept_hashes = {s: st.state_hash.hex() for s, st in zip(kept.stages, kept.states, strict=True)}
            assert kept_hashes == final, (kept_hashes, final)

            # New stage peers with fresh folders: nobody serves the stages, no replica, no checkpoint.
            new = [start_run_peer(tmp_path / f"new{i}", join) for i in range(2)]
            assert sorted(p.ready["stage"] for p in new) == [0, 1]
            assert [p.ready["state_source"] for p in new] == ["kept", "kept"], [p.ready for p in new]
            assert {p.ready["stage"]: p.ready["state_hash"] for p in new} == kept_hashes
            for i, p in enumerate(new):
                text = (tmp_path / f"new{i}.log").read_text()
                line = f"stage {p.ready['stage']}: restored from the coordinator's kept set of run step {STEPS} " \
                       f"(hash {kept_hashes[p.ready['stage']][:16]})"
                assert line in text, text[-2000:]
            after = val_through(join, net.run_id, new, batches)
        finally:
            stop_all(peers)
            stop_all(new)
    assert abs(after - val) < 1e-4, (after, val)  # the driver's last validation loss
    assert after < fresh - 0.1, (after, fresh)  # not a fresh model's


def test_a_stage_that_exists_nowhere_waits_for_the_operator(tmp_path, small_shards):
    """Nothing kept (keep.every_s = 0), no replica, no checkpoint, every stage peer gone after the
    run trained: a new stage peer does not serve its stage from the seed's weights. The run waits
    (a state_lost event, `admin status`) until `murmur admin runs recover --from scratch`."""
    overrides = [*KEEP, "keep.every_s=0"]
    with coordinator(tmp_path, small_shards, joins=4, overrides=overrides, coordinator_args=FAST_COORDINATOR) as (
            net, join):
        peers, new = [], []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
            out = finish(driver)
            assert driver.returncode == 0, out[-3000:]
            stop_all(peers)
            wait_until("the stage peers gone from the view",
                       lambda: not net.admin("stages", "--run", net.run_id)["peers"], timeout_s=60)
            log = tmp_path / "new.log"
            with open(log, "ab") as err:  # the child holds its own descriptor
                proc = start_logged("murmur.node.pipeline.stage_peer_process",
                                    ["--coordinator", join[0], "--token", join[1]], tmp_path / "new", stderr=err)
            new = [PeerProc(proc, {})]
            wait_until("a state_lost event", lambda: net.admin("events", "--run", net.run_id, "--kind",
                                                               "state_lost")["events"], timeout_s=120)
            status = net.admin("status", "--run", net.run_id)
            assert f"newest state (round {STEPS}) exists nowhere" in status["waiting_for_operator"], status
            wait_until("the peer's line", lambda: "the run waits for its operator" in log.read_text(), timeout_s=60)
            assert not proc.records() and proc.poll() is None, log.read_text()[-2000:]  # not serving, not gone
            net.admin("runs", "recover", net.run_id, "--from", "scratch")
            (ready,) = wait_until("the peer serving", lambda: [r for r in proc.records() if r.get("event") == "ready"],
                                  timeout_s=120)
            new[0].ready = ready
            assert ready["state_source"] == "seed", ready
            assert f"going on from the seed's weights at run step {STEPS} (the operator's call: from scratch)" \
                in log.read_text(), log.read_text()[-2000:]
        finally:
            stop_all(peers)
            stop_all(new)
