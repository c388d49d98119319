"""Within-stage sync rounds counted in the run's samples (node/pipeline/stage_sync.py), with real
processes on loopback: two peers of stage 0 and one of stage 1 under a coordinator, one driver.
The rounds' ids are the multiples of ``pipeline.sync_every_samples`` that the run's ledger passed,
whatever the seconds: on the clock (``sync_every_s`` a minute here) the same microbatches would
see no round, or one whose id is the Unix time over a minute."""

from __future__ import annotations

import pytest
from _pipeline_helpers import TOKENS_PER_MB, coordinator, finish, records, start_driver, start_run_peer, stop_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MICROBATCHES = 24
EVERY = 16  # samples between two rounds: four microbatches of 4
PIPELINE = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=0.0",
    "pipeline.target_samples=4", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "optim.warmup_steps=0", f"pipeline.sync_every_samples={EVERY}",
    # 20 s: the round's deadline (3/4 of it) and the still ledger's round, which the run does not
    # wait for (the peers are stopped when the driver is done). Not more: a stopping peer serves its
    # last round's result for a deadline, and a minute's made this test 52 s. No last round at the
    # stop: the stopped line's last round is then the samples' one.
    "pipeline.sync_every_s=20.0", "pipeline.checkpoint_every_s=0.0", "pipeline.stop_sync_s=0.0",
    "sync.outer_lr=1.0", "sync.outer_momentum=0.0",
]


def test_stage_mates_sync_at_the_multiples_of_samples_the_ledger_passes(tmp_path, byte_dataset):
    with coordinator(tmp_path, byte_dataset.root, joins=4, overrides=PIPELINE) as (net, join):
        peers = []
        try:
            for i in range(3):  # stages 0, 1, 0: two peers of stage 0, one of stage 1
                peers.append(start_run_peer(tmp_path / f"peer{i}", join))
            assert [p.ready["stage"] for p in peers] == [0, 1, 0]
            driver = start_driver(None, tmp_path, byte_dataset.root, "driver", "--microbatches", str(MICROBATCHES),
                                  "--concurrency", "2", join=join)
            out = finish(driver)
            assert driver.returncode == 0, out[-3000:]
        finally:
            stop_all(peers)
    assert records(out, "done")[0]["committed_tokens"] == MICROBATCHES * TOKENS_PER_MB
    samples = MICROBATCHES * 4  # the ledger's total in sequences: microbatches of 4
    mates = [p for p in peers if p.ready["stage"] == 0]
    lone = next(p for p in peers if p.ready["stage"] == 1)
    fields = ["sync_rounds", "sync_idle_rounds", "sync_failed", "sync_last_round", "sync_last_error", "samples_total"]
    seen = [{k: p.stopped.get(k) for k in fields} for p in mates]
    for p in mates:
        assert p.proc.returncode == 0 and p.stopped, p.lines[-3:]
        st = p.stopped
        # Rounds whose ids are the ledger's multiples of EVERY samples: at least two of the six it
        # passed (a round that outlasts a multiple, under load, runs the next one late),
        # the last within the run's samples.
        assert st["sync_rounds"] + st["sync_idle_rounds"] >= 2, seen
        assert 0 < st["sync_last_round"] <= samples and st["sync_last_round"] % EVERY == 0, seen
    # The peer alone in its stage has nobody to sync with: no round.
    assert lone.stopped["sync_rounds"] == lone.stopped["sync_idle_rounds"] == 0
