"""A peer that joins a stage fetches the stage's state from its peers (hash-verified) and serves."""

from __future__ import annotations

import pytest
from _pipeline_helpers import (
    TOKENS_PER_MB,
    finish,
    records,
    stage_peers,
    start_driver,
    start_peer,
    stop_peer,
    write_peers,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def run_driver(ca, tmp_path, data, name, count):
    d = start_driver(ca, tmp_path, data, name, "--microbatches", str(count), "--concurrency", "2")
    out = finish(d)
    assert d.returncode == 0, out
    return out


def test_a_peer_joining_a_stage_fetches_the_trained_state_and_takes_over(tmp_path, byte_dataset):
    with stage_peers(tmp_path, [[[]], [[]]]) as (ca, peers):
        donor = peers[1]
        run_driver(ca, tmp_path, byte_dataset.root, "driver1", 16)  # 64 rows: 8 steps of 8
        joiner = start_peer(ca, tmp_path / "joiner", 1, "--state-from", str(tmp_path / "peers.json"))
        peers.append(joiner)  # the fixture stops it
        assert joiner.ready["fetched_from"] == [donor.node_id]
        stop_peer(donor)  # it did nothing since: its weights are those the joiner fetched
        assert donor.stopped["optimizer_steps"] == 8
        assert joiner.ready["state_hash"] == donor.stopped["state_hash"]
        assert joiner.ready["state_hash"] != donor.ready["state_hash"]  # trained, not the seed's
        write_peers(tmp_path / "peers.json", [peers[0], joiner])
        out = run_driver(ca, tmp_path, byte_dataset.root, "driver2", 8)
    assert records(out, "done")[0]["committed_tokens"] == 8 * TOKENS_PER_MB
    assert all(h[2] == joiner.node_id for r in records(out, "microbatch") for h in r["hops"] if h[0] == 1)
    assert joiner.stopped["samples_total"] == 8 * 4
