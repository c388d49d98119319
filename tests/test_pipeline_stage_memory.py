"""A stage peer process holds its stage, not the model: 1 of 4 stages holds a quarter of the
blocks, and its peak resident memory stays under what the whole model's weights alone take; with
the fault tolerance on (sync, replica, checkpoints), a peer of 1 of 4 stages stays within a bound
derived from its stage's parameters, holds no sync state alone in its stage, and keeps the next
stage's replica on disk."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess

import pytest
import torch
from _net_helpers import REPO, python_env
from _pipeline_helpers import START_TIMEOUT

from murmur.node.pipeline.config import pipeline_model_config
from murmur.node.testnet.procs import start_module
from murmur.protocol.identity import CertificateAuthority

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MIB = 1 << 20
# Blocks large enough that the weights dwarf the interpreter, torch and grpc (~900 MiB in all).
SHAPE = {"n_layers": 8, "dim": 1536, "hidden_dim": 4096, "seq_len": 64}
ARGS = ["--stages", "4", "--preset", "tiny", *(a for k, v in SHAPE.items() for a in (f"--{k.replace('_', '-')}",
                                                                                     str(v)))]


def run_peer(tmp_path, *extra: str) -> subprocess.Popen[str]:
    ident = tmp_path / "peer"
    CertificateAuthority.create("mem-test").issue().save(ident)
    return start_module("murmur.node.pipeline.stage_peer_process",
                        ["--identity", str(ident), "--run", "mem-test", *extra, "--progress-every", "0"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(), cwd=REPO)


def test_a_stage_peer_holds_a_quarter_of_the_blocks_and_its_memory_follows(tmp_path):
    cfg = pipeline_model_config("tiny", 4, **SHAPE)
    whole_mb = cfg.num_params() * 4 / MIB  # fp32 weights of the whole model, nothing else
    block_mb = (cfg.num_params() - 2 * cfg.vocab_size * cfg.dim - cfg.dim) * 4 / MIB / cfg.n_layers
    proc = run_peer(tmp_path, "--stage", "1", *ARGS)
    try:
        line = proc.stdout.readline()  # the first line is "ready", or the process ended
        assert line, proc.communicate(timeout=START_TIMEOUT)[1]
        ready = json.loads(line)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=START_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    stopped = [json.loads(x) for x in out.splitlines() if '"stopped"' in x][0]
    assert (ready["stage"], ready["first_block"], ready["end_block"], ready["device"]) == (1, 2, 4, "cpu")
    # its parameters: its two blocks of eight, to the byte
    assert ready["stage_param_mb"] == pytest.approx(2 * block_mb, abs=1e-3)
    # Building the stage cost about the stage (the whole model built and cut would cost it all).
    built = ready["built_peak_rss_mb"] - ready["start_rss_mb"]
    assert built < 0.5 * whole_mb, (built, whole_mb)
    # Serving, with its gradient sums and the published copy of its weights: three stages' worth,
    # still less than the whole model's weights alone (whose training state is four times that).
    serving = stopped["peak_rss_mb"] - ready["start_rss_mb"]
    assert serving < whole_mb, (serving, whole_mb)
    assert built >= 0.9 * ready["stage_param_mb"]  # the figure measures something: the weights are in it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is")
def test_a_gpu_stage_peer_without_a_gpu_is_refused_in_one_line(tmp_path):
    proc = run_peer(tmp_path, "--stage", "0", "--stages", "2", "--device", "cuda")
    with contextlib.suppress(subprocess.TimeoutExpired):
        out, err = proc.communicate(timeout=START_TIMEOUT)
    if proc.poll() is None:
        proc.kill()
        pytest.fail("the stage peer kept running with --device cuda and no GPU")
    assert proc.returncode == 1 and not out
    assert err.strip() == "error: --device cuda was asked for but no CUDA device is available: use --device cpu", err


# A 4-stage run of one peer a stage with the fault tolerance on, every period short so that each
# copy happens many times: sync rounds (a peer alone holds no state), the next stage's replica,
# checkpoints on the clock and at the stop. One block of dim 1024 a stage (40 MiB of weights): the
# stage, not the process's fixed costs, decides the peak. 8 run steps (a step a microbatch): at 16,
# a microbatch took 8-27 s at load 22 (each stage writes a checkpoint every 2 s under its lock) and
# the driver ran past the helpers' 240 s.
SHIPPED = [
    "model.dim=1024", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8", "model.hidden_dim=2048",
    "model.seq_len=16", "pipeline.stages=4", "pipeline.microbatch_size=2", "pipeline.target_samples=2",
    "train.batch_size=2", "train.steps=8", "train.eval_every=100000", "optim.warmup_steps=0",
    "pipeline.sync_every_s=2.0", "pipeline.replica_every_s=1.0", "pipeline.checkpoint_every_s=2.0",
    "pipeline.rebalance_every_s=600.0", "pipeline.hop_timeout_s=120.0",
]
# The bound: 1.5 x the stage's training state (weights + gradients + AdamW's two moments, fp32: the
# issue's target, which benchmarks/peer_memory.py meets on the 84.4M model with the shipped periods)
# plus what a peer pays whatever its stage: its stage service and peer server, one transfer's
# buffers in flight each way (a replica served, one fetched), the allocator. Measured 250-370 MiB
# above base here (periods of 1-2 s: a transfer and a step overlap often); before, a peer of this
# run held 5 times its stage's training state (820 MiB).
STATE_BOUND = 1.5
FIXED_MB = 200.0


def test_a_stage_peer_of_four_with_sync_replica_and_checkpoints_on_stays_within_its_stage(tmp_path, small_shards):
    from _pipeline_helpers import coordinator, finish, start_driver, start_run_peer, stop_all

    peers = []
    with coordinator(tmp_path, small_shards, joins=6, overrides=SHIPPED,
                     coordinator_args=["--restart-grace", "1"]) as (_net, join):
        try:
            for i in range(4):  # one at a time: each joins the emptiest stage
                peers.append(start_run_peer(tmp_path / f"peer-{i}", join, "--state-dir", str(tmp_path / f"state-{i}"),
                                            "--progress-every", "0"))
            driver = start_driver(None, tmp_path, small_shards, "driver", join=join)
            finish(driver)
            assert driver.returncode == 0
        finally:
            stop_all(peers)
    assert sorted(p.ready["stage"] for p in peers) == [0, 1, 2, 3]
    for p in peers:
        stage_state_mb = 4 * p.ready["stage_param_mb"]  # fp32 weights, gradient sums, AdamW's two moments
        over = p.stopped["peak_rss_mb"] - p.ready["start_rss_mb"]
        assert p.stopped["optimizer_steps"] >= 4 and p.stopped["checkpoints_written"] >= 2, p.stopped
        assert over <= STATE_BOUND * stage_state_mb + FIXED_MB, (p.ready["stage"], over, stage_state_mb)
        assert over >= stage_state_mb  # the figure measures something: the training state is in it
        assert p.stopped["sync_holds_state"] is False  # alone in its stage: no anchor, nothing published
    for i in range(4):
        assert list((tmp_path / f"state-{i}" / "replica").glob("replica-stage-*.bin")), "the replica is on disk"
