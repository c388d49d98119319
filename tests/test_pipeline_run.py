"""A pipelined run that goes on, with real processes on loopback: drivers follow the run's schedule
shard after shard, evaluate the validation split through the stages into the ledger and
/api/status, resume from the ledger after a SIGKILL with nothing counted twice, and wait for a stage
emptied by SIGKILL to be refilled instead of giving up."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest
from _pipeline_helpers import (
    SMALL_SHARD_TOKENS,
    coordinator,
    finish,
    ledger_tokens,
    records,
    start_driver,
    start_run_peer,
    stop_all,
    wait_until,
)

from murmur.coordinator.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOKENS_PER_MB = 4 * 64  # the tiny testnet config's seq_len, 4 rows a microbatch
HEARTBEAT_TTL_S = 3.0
PIPELINE = [
    "pipeline.stages=2", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=1.0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "train.batch_size=4", "train.eval_batches=2", "optim.warmup_steps=2",
]
FAST_COORDINATOR = ["--heartbeat-ttl", str(HEARTBEAT_TTL_S), "--restart-grace", "1"]


def logged(path) -> list[dict]:
    """The commits a driver's fsynced commit log holds."""
    return records(path.read_text(), "commit") if path.exists() else []


def consistent(net) -> None:
    store = Store(net.db)
    try:
        assert store.check_consistency() == []
    finally:
        store.close()


def test_drivers_follow_the_schedule_across_leases_and_the_val_loss_reaches_the_ledger(tmp_path, small_shards):
    steps = 40
    overrides = [*PIPELINE, f"train.steps={steps}", "train.eval_every=10"]
    with coordinator(tmp_path, small_shards, joins=3, overrides=overrides) as (net, join):
        peers = []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
            out = finish(driver)
            tokens, _ = ledger_tokens(net)
            api = json.loads(urllib.request.urlopen(f"http://{net.info['metrics']}/api/status", timeout=30).read())
        finally:
            stop_all(peers)
    consistent(net)
    assert driver.returncode == 0, out[-3000:]
    (done,) = records(out, "done")
    assert done["reason"] == "schedule done", done
    # exactly the schedule: 40 run steps of 4 sequences, over two leases (32 microbatches a shard)
    assert tokens == steps * TOKENS_PER_MB == done["committed_tokens"], (tokens, done)
    commits = records(out, "commit")
    assert done["committed_microbatches"] == done["committed_end"] == commits[-1]["end"] > 0  # not 0
    assert [c["start"] for c in commits] == [0] + [c["end"] for c in commits[:-1]]  # contiguous, each once
    assert sum(c["tokens"] for c in commits) == tokens
    # shard 0 whole (its last microbatch holds 3 sequences and the shard's tail), then shard 1
    assert [(r["shard"], r["start"]) for r in records(out, "lease")] == [(0, 0), (1, 0)]
    assert [c["ledger_end"] for c in commits if c["shard"] == 0][-1] == SMALL_SHARD_TOKENS
    # an evaluation every 10 run steps, through the stages, carried to the ledger by the commit
    vals = records(out, "val")
    assert [v["step"] for v in vals] == [10, 20, 30, 40], vals
    assert vals[-1]["val_loss"] < vals[0]["val_loss"], vals
    charted = [r["val_loss"] for r in api["rounds"] if r["val_loss"] is not None]
    assert charted == pytest.approx([v["val_loss"] for v in vals]), api["rounds"]
    assert max(r["round"] for r in api["rounds"]) == steps  # the chart's x: the run's step
    # both stages stepped at the schedule's lr: warm-up, then cosine down towards min_lr_ratio x lr
    for p in peers:
        # Each backward tells the stage the ledger total its driver knows: the run's, less the
        # microbatches in flight (their commits come after their backwards). The schedule's end is
        # known only from the stage's own poll, which the stop may come before.
        assert steps - 3 <= p.stopped["run_step"] <= steps, p.stopped
        # lr 3e-3, decayed by the cosine to near min_lr_ratio at the schedule's end
        assert 0.1 * 3e-3 <= p.stopped["lr"] < 0.8 * 3e-3, p.stopped
        assert p.stopped["optimizer_steps"] in (19, 20), p.stopped  # 159 or 160 samples, 8 a step


def test_a_driver_killed_and_restarted_resumes_from_the_ledger_with_nothing_counted_twice(tmp_path, small_shards):
    steps = 48
    overrides = [*PIPELINE, f"train.steps={steps}", "train.eval_every=1000"]
    with coordinator(tmp_path, small_shards, joins=4, overrides=overrides,
                     coordinator_args=FAST_COORDINATOR) as (net, join):
        peers = []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            first = start_driver(None, tmp_path, small_shards, "first", join=join)
            wait_until("the first driver's commits", lambda: sum(c["end"] - c["start"]
                                                              for c in logged(tmp_path / "first.commits")) >= 8)
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=60)
            # its lease goes back once the coordinator has lost it (heartbeat TTL and a sweep)
            wait_until("the killed driver's lease to go back", lambda: ledger_tokens_and_free(net), timeout_s=60)
            _, offsets = ledger_tokens(net)
            second = start_driver(None, tmp_path, small_shards, "second", join=join)
            out = finish(second)
            tokens, _ = ledger_tokens(net)
        finally:
            stop_all(peers)
    consistent(net)
    assert second.returncode == 0, out[-3000:]
    (done,) = records(out, "done")
    assert done["reason"] == "schedule done", done
    # the restarted driver resumes the interrupted shard at the ledger's offset, not at 0
    lease = records(out, "lease")[0]
    assert (lease["shard"], lease["start"]) == (0, offsets[0]) and offsets[0] > 0, (lease, offsets)
    # what the ledger holds is the schedule, each token once: the first driver's commits (those it
    # logged, and one it may have made but was killed before logging) plus the second's
    first_tokens = sum(c["tokens"] for c in logged(tmp_path / "first.commits"))
    assert tokens == steps * TOKENS_PER_MB, tokens
    assert done["committed_tokens"] == tokens - offsets[0], (done, offsets)
    assert 0 <= offsets[0] - first_tokens <= 2 * TOKENS_PER_MB, (offsets, first_tokens)


def ledger_tokens_and_free(net) -> bool:
    from _node_helpers import ledger

    _, offsets, holders = ledger(net)
    return offsets.get(0, 0) > 0 and not holders.get(0)


def test_a_stage_emptied_by_sigkill_is_refilled_and_the_same_drivers_go_on(tmp_path, small_shards):
    """Stage 1's only peer is SIGKILLed mid-run. The drivers (default microbatch_attempts: 3, which
    used to give up about 3 s after the stage emptied) wait for the coordinator to move a stage-0
    peer there (it takes its replica) and go on training to the schedule's end."""
    steps = 72
    overrides = [*PIPELINE, f"train.steps={steps}", "train.eval_every=1000"]
    with coordinator(tmp_path, small_shards, joins=6, overrides=overrides,
                     coordinator_args=FAST_COORDINATOR) as (net, join):
        peers = []
        try:
            # Stage 1's peer (the second to start) computes slowly until it is killed: the schedule
            # took 3 s on a quiet machine, and a driver that started a few seconds after the other
            # made its first commit when the run was at step 65 of 72, so the kill came after both
            # drivers were done and neither trained through the moved peer.
            slow = ["--fault", "delay:stage_compute:0.05@x*"]
            peers = [start_run_peer(tmp_path / f"peer{i}", join, *(slow if i == 1 else [])) for i in range(3)]
            assert [p.ready["stage"] for p in peers] == [0, 1, 0]

            def replicas():
                view = net.admin("stages", "--peers")
                return all(p["report"]["replica_stage"] == 1 for p in view["peers"] if p["report"]["stage"] == 0)

            wait_until("stage 0's copies of stage 1", replicas)
            drivers = [start_driver(None, tmp_path, small_shards, f"d{i}", join=join) for i in range(2)]
            wait_until("both drivers' first commits", lambda: all(logged(tmp_path / f"d{i}.commits") for i in range(2)))
            killed_at = time.time()
            peers[1].proc.send_signal(signal.SIGKILL)
            peers[1].proc.wait()
            outs = [finish(d) for d in drivers]
            tokens, _ = ledger_tokens(net)
            moves = net.admin("events", "--kind", "stage_move")["events"]
        finally:
            stop_all(peers)
    consistent(net)
    for d, out in zip(drivers, outs, strict=True):
        assert d.returncode == 0, out[-3000:]
        (done,) = records(out, "done")
        assert done["reason"] == "schedule done", done
        # this very driver trained after the refill: microbatches through the moved peer
        after = [r for r in records(out, "microbatch") if r["at"] > killed_at]
        assert after and any(h[2] == moves[0]["node_id"] for r in after for h in r["hops"] if h[0] == 1), out[-2000:]
    (move,) = moves
    assert move["detail"]["reason"] == "empty stage"
    committed = sum(records(out, "done")[0]["committed_tokens"] for out in outs)
    assert tokens == committed  # every committed token counted once
    # The schedule, give or take the microbatches in flight (and a second of the other driver's
    # commits) when it ended, and those a driver held done but uncommitted behind one lost with
    # the killed peer: a lease commits in order, so they reach the ledger (and the other driver's
    # view of the schedule) only once that one's retry is through (18 of them seen under load).
    held = max(c["end"] - c["start"] for out in outs for c in records(out, "commit"))
    assert steps * TOKENS_PER_MB <= tokens <= (steps + 16 + held) * TOKENS_PER_MB, (tokens, held)


def test_a_driver_refuses_a_device_this_machine_does_not_have_in_one_line(tmp_path, small_shards):
    import subprocess

    from _net_helpers import REPO, python_env

    from murmur.node.testnet.procs import start_module

    proc = start_module("murmur.node.pipeline.driver_process",
                        ["--coordinator", "127.0.0.1:9", "--token", "x", "--data", str(small_shards),
                         "--device", "cuda:99"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=python_env(), cwd=REPO)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: --device cuda:99"), err


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_driver_on_a_gpu_drives_the_stages(tmp_path, small_shards):
    overrides = [*PIPELINE, "train.steps=8", "train.eval_every=4"]
    with coordinator(tmp_path, small_shards, joins=3, overrides=overrides) as (net, join):
        peers = []
        try:
            peers = [start_run_peer(tmp_path / f"peer{i}", join) for i in range(2)]
            driver = start_driver(None, tmp_path, small_shards, "driver", "--device", "cuda", join=join)
            out = finish(driver)
        finally:
            stop_all(peers)
    assert driver.returncode == 0, out[-3000:]
    (done,) = records(out, "done")
    assert done["device"].startswith("cuda") and done["committed_tokens"] == 8 * TOKENS_PER_MB, done
    assert [v["step"] for v in records(out, "val")] == [4, 8]
