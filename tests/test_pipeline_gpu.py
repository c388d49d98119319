"""A stage on a GPU: built there from the same seeded draws as on the CPU, computing under bf16
autocast over fp32 weights, answering on the CPU for the wire. Skipped without a CUDA device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.pipeline import stage_state
from murmur.node.pipeline.config import autocast_of
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.runconfig import OptimSection

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = dataclasses.replace(model_config("tiny", n_layers=4, dim=128, hidden_dim=352, seq_len=64), tie_embeddings=False)
OPTIM = OptimSection(lr=1e-3, warmup_steps=0, grad_clip=0.0)


def test_a_gpu_stage_starts_from_the_cpu_stages_weights_and_computes_alike():
    spans = split_layers(CFG.n_layers, 2)
    cpu = [build_stage(CFG, 9, s) for s in spans]
    gpu = [build_stage(CFG, 9, s, "cuda") for s in spans]
    for c, g in zip(cpu, gpu, strict=True):
        assert g.device.type == "cuda" and all(p.is_cuda for p in g.parameters())
        assert stage_state.state_hash(c) == stage_state.state_hash(g)  # the same weights, bit for bit
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    y = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    wc = [StageWorker(m, OPTIM, target_samples=2) for m in cpu]
    wg = [StageWorker(m, OPTIM, target_samples=2) for m in gpu]
    hc, hg = wc[0].forward(x), wg[0].forward(x)
    assert hg.device.type == "cpu" and torch.allclose(hg, hc, atol=1e-4, rtol=1e-3)
    bc, bg = wc[1].backward(hc, targets=y), wg[1].backward(hg, targets=y)
    assert bg.grad_inputs.device.type == "cpu" and abs(bg.loss - bc.loss) < 1e-4
    assert bg.stepped and wg[1].stats.optimizer_steps == 1


def test_bf16_autocast_keeps_fp32_master_weights_and_trains():
    (first, last) = split_layers(CFG.n_layers, 2)
    dtype = torch.bfloat16 if autocast_of("auto", torch.device("cuda")) == "bf16" else None
    assert dtype is torch.bfloat16
    stages = [build_stage(CFG, 1, s, "cuda", autocast_dtype=dtype) for s in (first, last)]
    workers = [StageWorker(m, OptimSection(lr=3e-3, warmup_steps=0, grad_clip=0.0), target_samples=4)
               for m in stages]
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
