"""A pipelined run whose every stage peer and driver is SIGKILLed at once resumes from the stage
peers' checkpoints, not from the seed, with real processes on loopback: the val loss through the
restarted stages is within 1% of the one before the kill, the restarted driver goes on from the
ledger, and `murmur export` of the peers' folders is the model the stages serve."""

from __future__ import annotations

import math
import signal
import time

import pytest
from _pipeline_helpers import (
    coordinator,
    ledger_tokens,
    start_driver,
    start_run_peer,
    stop_all,
    val_through_stages,
    wait_until,
)
from test_pipeline_run import FAST_COORDINATOR, PIPELINE, consistent, logged

from murmur.node.export.source import SourceError
from murmur.node.export.stage_set import load_sources
from murmur.node.model.data import Dataset, eval_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EVERY_S = 1.0  # pipeline.checkpoint_every_s
RESUME = [*PIPELINE, "pipeline.activation_codec=fp32", f"pipeline.checkpoint_every_s={EVERY_S}",
          "train.steps=100000", "train.eval_every=100000"]


def exported_val(source, batches) -> float:
    import torch

    model = source.build_model()
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in batches) / len(batches)


def test_every_peer_and_driver_killed_at_once_resume_from_the_checkpoints(tmp_path, small_shards):  # noqa: F811
    batches = eval_batches(Dataset.open(small_shards), 4, 64, 4)
    states = [tmp_path / f"state{i}" for i in range(2)]
    with coordinator(tmp_path, small_shards, joins=8, overrides=RESUME,
                     coordinator_args=FAST_COORDINATOR) as (net, join):
        peers, restarted, drivers = [], [], []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join, "--state-dir", str(states[i])) for i in range(2)]
            assert sorted(p.ready["stage"] for p in peers) == [0, 1]
            assert all(p.ready["checkpoint_version"] is None for p in peers)  # a new run: the seed
            drivers.append(start_driver(None, tmp_path, small_shards, "first", join=join))
            wait_until("40 microbatches trained", lambda: sum(c["end"] - c["start"]
                                                          for c in logged(tmp_path / "first.commits")) >= 40)
            # Freeze the driver, so that nothing trains between the checkpoint and the kill.
            drivers[0].send_signal(signal.SIGSTOP)
            frozen_at = time.time()

            def set_after_freeze():
                sets = net.admin("events", "--kind", "stage_checkpoint_set")["events"]
                return [e for e in sets if e["detail"]["version"] * EVERY_S > frozen_at + 2.0]

            recorded = wait_until("a complete checkpoint set after the freeze", set_after_freeze, timeout_s=120)[0]
            before = val_through_stages(join, net.run_id, peers, batches)
            assert before < 0.9 * math.log(256), before  # trained well away from the seed's loss

            # SIGKILL every peer and the driver at once.
            for proc in [*(p.proc for p in peers), drivers[0]]:
                proc.send_signal(signal.SIGKILL)
            for proc in [*(p.proc for p in peers), drivers[0]]:
                proc.wait(60)
            drivers[0].communicate(timeout=60)
            tokens_at_kill, _ = ledger_tokens(net)

            restarted = [start_run_peer(tmp_path / f"again{i}", join, "--state-dir", str(states[i])) for i in range(2)]
            # each serves the stage it checkpointed, from its own checkpoint
            assert [p.ready["stage"] for p in restarted] == [p.ready["stage"] for p in peers]
            assert [p.ready["state_source"] for p in restarted] == ["checkpoint", "checkpoint"], \
                [p.ready for p in restarted]
            assert all(p.ready["checkpoint_version"] >= recorded["detail"]["version"] for p in restarted)
            after = val_through_stages(join, net.run_id, restarted, batches)
            assert abs(after - before) <= 0.01 * before, (before, after)

            # `murmur export` of the peers' folders: the model the stages serve. The restarted peers
            # checkpoint every second, each keeping its newest version and a multiple of SPARSE:
            # read while one peer had written version v and the other not yet (v - 1 dropped), the
            # newest complete set was the older sparse one, from early in the training (a loaded
            # run exported 5.46 against the stages' 3.35). The export is read again until its
            # set is no older than the one the peers restarted from.
            loaded = max(p.ready["checkpoint_version"] for p in restarted)

            def export_from_restart():
                try:
                    got = load_sources(states)
                except (SourceError, OSError):  # a file dropped between the listing and the read
                    return None
                return got if got.provenance["round"] >= loaded else None

            source = wait_until("an export of the restarted peers' checkpoints", export_from_restart, timeout_s=60)
            assert source.kind == "pipeline stages" and source.model.tie_embeddings is False
            assert exported_val(source, batches) == pytest.approx(after, abs=1e-4)

            # the restarted driver resumes from the ledger, and the restored stages train on
            drivers.append(start_driver(None, tmp_path, small_shards, "second", join=join))
            wait_until("the second driver's commits", lambda: sum(c["end"] - c["start"]
                                                              for c in logged(tmp_path / "second.commits")) >= 16)
            drivers[1].send_signal(signal.SIGTERM)
            drivers[1].communicate(timeout=120)
            tokens, _ = ledger_tokens(net)
        finally:
            for d in drivers:
                if d.poll() is None:
                    d.kill()
                    d.communicate(timeout=60)
            stop_all(restarted)
            for p in peers:
                if p.proc.poll() is None:
                    p.proc.kill()
    consistent(net)
    first, second = logged(tmp_path / "first.commits"), logged(tmp_path / "second.commits")
    # nothing counted twice (the ledger's consistency check: no range twice): the ledger holds the
    # first driver's commits (one it may have made but not logged before the kill included) and
    # the second's (a SIGTERM during a commit waits for its answer and logs it: cut off there, a
    # loaded run's ledger held 3 microbatches the log did not)
    assert 0 <= tokens - tokens_at_kill - sum(c["tokens"] for c in second) <= 2 * 256
    assert second and tokens > tokens_at_kill
    assert 0 <= tokens_at_kill - sum(c["tokens"] for c in first) <= 2 * 256
    for p in restarted:
        assert p.stopped["optimizer_steps"] > 0, p.stopped  # training went on, on the restored stages
        assert p.stopped["checkpoint_version"] > recorded["detail"]["version"]  # and was checkpointed again
