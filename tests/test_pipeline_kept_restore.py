"""A pipelined run outlives its stage peers (issue 50): the coordinator keeps the newest complete
set of stage states, pulled when the driver's lease ends, and new stage peers with fresh folders,
joining after every stage peer left, restore their stages from it (same hashes), so the model
through them scores the driver's last validation loss, not a fresh model's. Real coordinator,
stage peer and driver processes on loopback, real signals."""

from __future__ import annotations

import re

import pytest
from _durable_scenarios import (
    KEPT_STAGE,
    PIPELINE_KEEP,
    STEPS,
    join_stage_peer,
    pipeline_net,
    pipeline_trained_then_gone,
)
from _pipeline_helpers import PeerProc, start_logged, stop_all, val_through_stages, wait_until

from murmur.coordinator import kept_state
from murmur.node.model.data import Dataset, eval_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_new_stage_peers_restore_the_kept_stages_after_every_stage_peer_left(tmp_path, small_shards):
    batches = eval_batches(Dataset.open(small_shards), 4, 64, 2)  # the driver's validation set
    with pipeline_net(tmp_path, small_shards) as (net, join):
        peers, new, fresh = [], [], []
        try:
            val, (kept_event,) = pipeline_trained_then_gone(
                net, join, tmp_path, small_shards, peers,
                between=lambda serving: fresh.append(val_through_stages(join, net.run_id, serving, batches)))
            assert kept_event["detail"]["reason"] == "lease_end", kept_event  # the lease's end, not the clock
            final = {p.stopped["stage"]: p.stopped["state_hash"] for p in peers}
            kept = kept_state.newest(net.db, net.run_id)
            assert kept is not None and kept.kind == "stages" and kept.round == STEPS, kept
            kept_hashes = {s: st.state_hash.hex() for s, st in zip(kept.stages, kept.states, strict=True)}
            assert kept_hashes == final, (kept_hashes, final)

            # New stage peers with fresh folders: nobody serves the stages, no replica, no checkpoint.
            new = [join_stage_peer(tmp_path, join, f"new{i}").peer for i in range(2)]
            assert sorted(p.ready["stage"] for p in new) == [0, 1]
            assert [p.ready["state_source"] for p in new] == ["kept", "kept"], [p.ready for p in new]
            assert {p.ready["stage"]: p.ready["state_hash"] for p in new} == kept_hashes
            for i, p in enumerate(new):
                text = (tmp_path / f"new{i}.log").read_text()
                m = re.search(KEPT_STAGE, text)
                assert m and (int(m[1]), int(m[2])) == (p.ready["stage"], STEPS), text[-2000:]
                assert kept_hashes[p.ready["stage"]].startswith(m[3]), (m[0], kept_hashes)
            after = val_through_stages(join, net.run_id, new, batches)
        finally:
            stop_all(peers)
            stop_all(new)
    assert abs(after - val) < 1e-4, (after, val)  # the driver's last validation loss
    assert after < fresh[0] - 0.1, (after, fresh)  # not a fresh model's


def test_a_stage_that_exists_nowhere_waits_for_the_operator(tmp_path, small_shards):
    """Nothing kept (keep.every_s = 0), no replica, no checkpoint, every stage peer gone after the
    run trained: a new stage peer does not serve its stage from the seed's weights. The run waits
    (a state_lost event, `admin status`) until `murmur admin runs recover --from scratch`."""
    with pipeline_net(tmp_path, small_shards, overrides=[*PIPELINE_KEEP, "keep.every_s=0"], joins=4) as (net, join):
        peers, new = [], []
        try:
            pipeline_trained_then_gone(net, join, tmp_path, small_shards, peers, kept=False)
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
