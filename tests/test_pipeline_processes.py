"""Pipelines of real processes on loopback: 2 stages x 2 peers with drivers train; a SIGKILLed
stage peer's hops go to its stage-mate with the token count exact; a slow peer gets fewer
microbatches than its stage-mate."""

from __future__ import annotations

import asyncio
import signal
import statistics

import pytest
from _pipeline_helpers import (
    RUN_TIMEOUT,
    TOKENS_PER_MB,
    check_commits,
    coordinator,
    finish,
    ledger_tokens,
    records,
    stage_peers,
    start_driver,
    watcher_identity,
)

from murmur.node.net.loop import LoopThread
from murmur.node.pipeline.client import StageClient, StageEndpoint

# Five to seven processes, each importing torch, on a loaded 2-core machine: more than the default.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_two_stages_of_two_peers_and_two_drivers_train_and_the_loss_falls(tmp_path, byte_dataset):
    with (
        coordinator(tmp_path, byte_dataset.root, joins=6) as (net, join),
        stage_peers(tmp_path, [[[], []], [[], []]], join=join) as (ca, peers),
    ):
        drivers = [start_driver(ca, tmp_path, byte_dataset.root, f"driver{i}", "--microbatches", "40",
                                "--concurrency", "2", join=join) for i in range(2)]
        outs = [finish(d) for d in drivers]
        tokens, offsets = ledger_tokens(net)
    assert [d.returncode for d in drivers] == [0, 0], outs
    for out in outs:
        done = records(out, "microbatch")
        assert len(done) == 40
        losses = [r["loss"] for r in sorted(done, key=lambda r: r["index"])]
        first, last = statistics.mean(losses[:8]), statistics.mean(losses[-8:])
        assert last < first - 0.3, (first, last)
        check_commits(records(out, "commit"), 40)
        assert records(out, "done")[0]["committed_tokens"] == 40 * TOKENS_PER_MB
    # the coordinator's ledger: each driver's shard advanced by exactly its 40 microbatches
    assert tokens == 2 * 40 * TOKENS_PER_MB
    shards = [records(out, "lease")[0]["shard"] for out in outs]
    assert len(set(shards)) == 2 and all(offsets[s] == 40 * TOKENS_PER_MB for s in shards)
    # every peer served, and each stage's peers stepped their optimizers
    assert all(p.stopped.get("backwards", 0) > 0 for p in peers), [p.stopped or p.stop_error for p in peers]
    assert all(p.stopped["optimizer_steps"] > 0 for p in peers)
    for stage in (0, 1):  # the stage's peers together computed every microbatch's backward
        assert sum(p.stopped["samples_total"] for p in peers if p.ready["stage"] == stage) == 80 * 4


def test_a_sigkilled_stage_peer_mid_microbatch_its_hops_go_to_its_stage_mate(tmp_path, byte_dataset):
    # The victim computes slowly, so the kill lands while it holds a microbatch.
    with (
        coordinator(tmp_path, byte_dataset.root, joins=6) as (net, join),
        stage_peers(tmp_path, [[[]], [["--fault", "delay:stage_compute:0.3@x*"], []]], join=join) as (ca, peers),
    ):
        victim, mate = peers[1], peers[2]
        driver = start_driver(ca, tmp_path, byte_dataset.root, "driver", "--microbatches", "50",
                              "--concurrency", "2", "--hop-timeout-s", "20", join=join)
        loop = LoopThread()
        client = StageClient(watcher_identity(join), run_id=net.run_id)
        try:
            async def busy() -> None:  # until the victim is computing a hop
                peer = StageEndpoint(victim.node_id, victim.ready["address"], 1)
                while (await client.info(peer)).queue == 0:
                    await asyncio.sleep(0.01)
            loop.run(busy(), timeout=RUN_TIMEOUT)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
        finally:
            loop.run(client.aclose())
            loop.stop()
        out = finish(driver)
        tokens, _ = ledger_tokens(net)
    assert victim.proc.returncode == -signal.SIGKILL
    assert driver.returncode == 0, out
    done = records(out, "microbatch")
    assert sorted(r["index"] for r in done) == list(range(50))  # none lost, none twice
    check_commits(records(out, "commit"), 50)
    assert records(out, "done")[0]["committed_tokens"] == 50 * TOKENS_PER_MB
    assert tokens == 50 * TOKENS_PER_MB  # the ledger's count is exact
    retried = [r for r in done if r["retries"]]
    assert retried, "no hop was retried although a peer died under one"
    # a retried hop of stage 1 ended on the stage-mate
    assert any(h[0] == 1 and h[2] == mate.node_id and h[3] > 1 for r in retried for h in r["hops"])
    # after the kill the victim served nothing more: the last microbatches all went to the mate
    assert all(h[2] == mate.node_id for r in done[-10:] for h in r["hops"] if h[0] == 1)


def test_a_slowed_peer_gets_fewer_microbatches_than_its_stage_mate(tmp_path, byte_dataset):
    with stage_peers(tmp_path, [[[]], [["--fault", "delay:stage_compute:0.25@x*"], []]]) as (ca, peers):
        driver = start_driver(ca, tmp_path, byte_dataset.root, "driver", "--microbatches", "40",
                              "--concurrency", "2")
        out = finish(driver)
    assert driver.returncode == 0, out
    slow, fast = peers[1], peers[2]
    served = records(out, "done")[0]["hops_by_peer"]
    assert served[slow.node_id] > 0  # it was tried (new peers are) ...
    assert served[slow.node_id] * 2 < served[fast.node_id], served  # ... and then given less
    assert slow.stopped["samples_total"] * 2 < fast.stopped["samples_total"]
