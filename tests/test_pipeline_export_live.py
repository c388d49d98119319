"""`murmur export --coordinator` of a live pipelined run (issue 47 item 3): the coordinator names
each stage's live peers, the command fetches every stage's published state from them (checked
against the hash it is served under) and assembles one model that `murmur eval` scores as the
run's drivers reported. Real coordinator, stage peers and driver processes on loopback."""

from __future__ import annotations

import json
import subprocess

import pytest
from _net_helpers import PYTHON, REPO, python_env
from _pipeline_helpers import coordinator, finish, records, start_driver, start_run_peer, stop_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
CLI_TIMEOUT_S = 240
STEPS = 16
PIPELINE = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "pipeline.activation_codec=\"fp32\"", "train.batch_size=4", "train.eval_batches=2",
    "optim.warmup_steps=2", f"train.steps={STEPS}", f"train.eval_every={STEPS}", "keep.every_s=1",
]


def _murmur(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "murmur.cli", *args], capture_output=True, text=True,
                          env=python_env(), cwd=REPO, timeout=CLI_TIMEOUT_S)


def test_export_through_the_coordinator_assembles_a_live_pipelines_stages_and_scores_as_the_run(tmp_path, small_shards):
    with coordinator(tmp_path, small_shards, joins=3, overrides=PIPELINE) as (net, join):
        peers = []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
            out = finish(driver)
            assert driver.returncode == 0, out[-3000:]
            # The schedule is done: the stage peers serve their last weights, the ones the driver evaluated.
            model = tmp_path / "export"
            done = _murmur("export", "--coordinator", str(net.info["address"]), "--admin-key",
                           str(net.info["admin_key_file"]), "--out", str(model))
            assert done.returncode == 0, done.stderr[-3000:]
            events = net.admin("events", "--run", net.run_id, "--limit", "1000")["events"]
        finally:
            stop_all(peers)
    prov = json.loads((model / "provenance.json").read_text())
    assert prov["source_kind"] == "live pipeline" and prov["run_id"] == net.run_id and not prov["kept"], prov
    assert [s["stage"] for s in prov["stages"]] == [0, 1], prov["stages"]
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is False
    (val,) = [v for v in records(out, "val") if v["step"] == STEPS]
    scored = _murmur("eval", str(model), "--data", str(small_shards), "--output", "json")
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert abs(json.loads(scored.stdout)["loss"] - val["val_loss"]) < 1e-3, (scored.stdout, val)
    reads = [e for e in events if e["kind"] == "state_read"]
    assert reads, [e["kind"] for e in events]
    # The coordinator kept the pipeline's stages too (keep.every_s = 1): the same path, every stage.
    kept = [e for e in events if e["kind"] == "state_kept"]
    assert kept, [e["kind"] for e in events]
    assert list((net.db.parent / "coordinator.db.kept" / net.run_id).glob("round-*.state"))
