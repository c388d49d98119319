"""A stage on a GPU: built there from the same seeded draws as on the CPU, computing under bf16
autocast over fp32 weights, answering on the CPU for the wire (skipped without a CUDA device); and
what makes stage peers work on a GPU that a CPU can check: GPU processes are never forked from the
testnet's warm-start server, and a GPU stage's evaluation takes the wire's CPU tensors.

The GPU tests import only what the GPU machine has (torch, triton; no grpc, pydantic or hivemind):
they failed there at import, through node/pipeline/stage_state.py (grpc) and node/pipeline/config.py
(pydantic). Run them there from outside the repository root, or with ``python3 -P``: the root's
``murmur/`` folder (the CLI alone) would hide the package benchmarks/gpu_env.sh lays out.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from murmur.node.model.stages import StageModule, build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.pipeline import stage_checkpoint
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.wire import tensors_hash

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = dataclasses.replace(model_config("tiny", n_layers=4, dim=128, hidden_dim=352, seq_len=64), tie_embeddings=False)


@dataclasses.dataclass
class Optim:  # the fields of protocol/runconfig.py's OptimSection that StageWorker's AdamW reads
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 0
    grad_clip: float = 0.0


OPTIM = Optim()


def state_hash(module: StageModule) -> str:
    return tensors_hash((n, p.detach().cpu()) for n, p in module.named_stage_parameters()).hex()


def test_the_optimizer_stand_in_matches_the_run_configs_defaults():
    from murmur.protocol.runconfig import OptimSection

    real = OptimSection(lr=1e-3, warmup_steps=0, grad_clip=0.0)
    assert {f.name: getattr(real, f.name) for f in dataclasses.fields(Optim)} == dataclasses.asdict(OPTIM)


def test_a_gpu_stage_computes_under_bf16_autocast_by_default():
    from murmur.node.pipeline.config import autocast_of

    assert autocast_of("auto", torch.device("cuda")) == "bf16"
    assert autocast_of("auto", torch.device("cpu")) is None and autocast_of("fp32", torch.device("cuda")) is None


def test_gpu_processes_start_cold_not_forked_from_the_warm_start_server():
    """A child forked from a process in which CUDA was touched cannot use CUDA; the testnet's
    warm-start fork server imports torch and more, so a stage peer with --device cuda died at start
    on an H100. Such commands start with exec (node/testnet/warm.py)."""
    from murmur.node.testnet import warm

    assert warm.needs_gpu(["--device", "cuda"]) and warm.needs_gpu(["x", "--device=cuda:1"])
    assert warm.needs_gpu(["--device", "auto"]) == warm.gpu_here()  # auto: a GPU where there is one
    assert not warm.needs_gpu(["--device", "cpu", "--threads", "1"]) and not warm.needs_gpu(["--threads", "1"])
    proc = warm.popen(["--device", "cuda"], module="json.tool", env={"PATH": "/usr/bin:/bin"},
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert isinstance(proc, subprocess.Popen)  # exec'd, not a WarmProcess forked from the server
        assert proc.args[:3] == [sys.executable, "-m", "json.tool"]
    finally:
        proc.kill()
        proc.communicate()


def test_a_stage_evaluates_inputs_that_arrive_on_another_device():
    """The last stage's evaluation moves the wire's CPU tensors to its device, as forward and
    backward do (on a GPU stage it raised a device mismatch)."""
    last = split_layers(CFG.n_layers, 2)[1]
    worker = StageWorker(build_stage(CFG, 3, last), OPTIM, target_samples=2)
    moved = []
    real = worker.module.forward

    def spy(x, targets=None):
        moved.append((x.device, targets.device))
        return real(x, targets)

    worker.module.forward = spy
    h = torch.randn(2, CFG.seq_len, CFG.dim)
    y = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    assert 0 < worker.evaluate(h, y) < 10
    assert moved == [(worker.module.device, worker.module.device)]


@pytest.mark.gpu
@on_gpu
def test_a_gpu_stage_starts_from_the_cpu_stages_weights_and_computes_alike():
    spans = split_layers(CFG.n_layers, 2)
    cpu = [build_stage(CFG, 9, s) for s in spans]
    gpu = [build_stage(CFG, 9, s, "cuda") for s in spans]
    for c, g in zip(cpu, gpu, strict=True):
        assert g.device.type == "cuda" and all(p.is_cuda for p in g.parameters())
        assert state_hash(c) == state_hash(g)  # the same weights, bit for bit
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    y = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    wc = [StageWorker(m, OPTIM, target_samples=2) for m in cpu]
    wg = [StageWorker(m, OPTIM, target_samples=2) for m in gpu]
    hc, hg = wc[0].forward(x), wg[0].forward(x)
    assert hg.device.type == "cpu" and torch.allclose(hg, hc, atol=1e-4, rtol=1e-3)
    bc, bg = wc[1].backward(hc, targets=y), wg[1].backward(hg, targets=y)
    assert bg.grad_inputs.device.type == "cpu" and abs(bg.loss - bc.loss) < 1e-4
    assert bg.stepped and wg[1].stats.optimizer_steps == 1


@pytest.mark.gpu
@on_gpu
def test_bf16_autocast_keeps_fp32_master_weights_and_trains():
    (first, last) = split_layers(CFG.n_layers, 2)
    stages = [build_stage(CFG, 1, s, "cuda", autocast_dtype=torch.bfloat16) for s in (first, last)]
    workers = [StageWorker(m, Optim(lr=3e-3), target_samples=4) for m in stages]
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))
    losses = []
    for _ in range(8):
        h = workers[0].forward(x)
        back = workers[1].backward(h, targets=x)
        workers[0].backward(x, grad_outputs=back.grad_inputs)
        losses.append(back.loss)
    assert all(p.dtype == torch.float32 for m in stages for p in m.parameters())
    assert h.dtype == torch.float32 and back.grad_inputs.dtype == torch.float32
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.gpu
@on_gpu
def test_a_gpu_stage_checkpoints_from_host_copies_so_the_lock_covers_the_copy_alone():
    """A GPU stage's checkpoint is written from copies in host memory, taken under the lock: the
    stage steps on while the file is written, and the file still holds the state at the copy."""
    (first, last) = split_layers(CFG.n_layers, 2)
    worker = StageWorker(build_stage(CFG, 3, last, "cuda"), OPTIM, target_samples=2)
    x = torch.randn(2, CFG.seq_len, CFG.dim)
    y = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    assert worker.backward(x, targets=y).stepped
    params, opt, hold = stage_checkpoint.for_write(worker.module, worker.optimizer)
    assert not hold
    assert all(t.device.type == "cpu" for t in params.values())
    assert all(v.device.type == "cpu" for st in opt["state"].values() for v in st.values() if torch.is_tensor(v))
    at_copy = stage_checkpoint.params_hash(params)
    assert at_copy == state_hash(worker.module)
    assert worker.backward(x, targets=y).stepped  # the next step changes the stage, not the copies
    assert stage_checkpoint.params_hash(params) == at_copy != state_hash(worker.module)
