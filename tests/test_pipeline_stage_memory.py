"""A stage peer process holds its stage, not the model: 1 of 4 stages holds a quarter of the
blocks, and its peak resident memory stays under what the whole model's weights alone take."""

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
