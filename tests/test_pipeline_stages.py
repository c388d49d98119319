"""Stage cuts: the chain of stage modules trains exactly as the whole model does (fp32, CPU)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from murmur.node.model.stages import StageError, build_stage, cut, split_layers
from murmur.node.model.transformer import Transformer, model_config
from murmur.node.pipeline.worker import StageWorker
from murmur.optim.inner import make_inner_optimizer
from murmur.protocol.runconfig import OptimSection

CFG = dataclasses.replace(model_config("tiny", n_layers=5, dim=64, hidden_dim=160, seq_len=32), tie_embeddings=False)
OPTIM = OptimSection(lr=3e-3, weight_decay=0.1, warmup_steps=0, grad_clip=0.0)


def microbatches(steps: int, per_step: int, rows: int, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=gen),
             torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=gen))
            for _ in range(per_step)
        ]
        for _ in range(steps)
    ]


def test_even_and_explicit_splits():
    assert [(s.first_block, s.end_block) for s in split_layers(5, 2)] == [(0, 3), (3, 5)]
    assert [(s.first_block, s.end_block) for s in split_layers(6, 3, [1, 2, 3])] == [(0, 1), (1, 3), (3, 6)]
    for bad in ([1, 1, 1], [3, 3], [0, 5]):
        with pytest.raises(StageError):
            split_layers(5, len(bad) if len(bad) != 3 else 3, bad)
    with pytest.raises(StageError, match="at least one block"):
        split_layers(2, 3)


def test_tied_embeddings_are_refused_across_stages():
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    with pytest.raises(StageError, match="untied"):
        cut(Transformer(tied), split_layers(tied.n_layers, 2))
    (only,) = cut(Transformer(tied), split_layers(tied.n_layers, 1))  # one stage holds both ends
    idx = torch.randint(0, tied.vocab_size, (2, 8))
    assert torch.equal(only(idx), Transformer(tied)(idx))


def test_stage_parameters_are_the_whole_models_under_its_names():
    model = Transformer(CFG, seed=3)
    whole = dict(model.named_parameters())
    stages = [build_stage(CFG, 3, span) for span in split_layers(CFG.n_layers, 3)]
    seen = {}
    for stage in stages:
        seen.update({n: p for n, p in stage.named_stage_parameters()})
    assert list(seen) == list(whole)
    assert all(torch.equal(seen[n], whole[n]) for n in whole)


def test_a_stage_builds_only_its_own_modules():
    cfg = dataclasses.replace(CFG, n_layers=8)
    whole = Transformer(cfg, seed=4)
    block_params = sum(p.numel() for n, p in whole.named_parameters() if n.startswith("blocks."))
    spans = split_layers(cfg.n_layers, 4)
    stages = [build_stage(cfg, 4, span) for span in spans]
    middle = stages[1]
    # every tensor the module holds is its stage's: blocks 2 and 3, a quarter of the blocks, no more
    assert {n.split(".")[1] for n, _ in middle.named_stage_parameters()} == {"2", "3"}
    assert sum(p.numel() for p in middle.parameters()) == block_params // 4
    assert middle.embed is None and middle.norm is None and middle.lm_head is None
    assert stages[0].embed is not None and stages[0].lm_head is None
    assert stages[3].embed is None and stages[3].norm is not None and stages[3].lm_head is not None
    assert sum(s.parameter_bytes() for s in stages) == sum(p.numel() * 4 for p in whole.parameters())
    # and its weights are the whole model's, drawn without it
    ref = dict(whole.named_parameters())
    assert all(torch.equal(p, ref[n]) for s in stages for n, p in s.named_stage_parameters())
    assert not torch.equal(build_stage(cfg, 5, spans[1]).blocks[0].attn.wq.weight, middle.blocks[0].attn.wq.weight)


def test_one_stage_with_tied_embeddings_is_the_whole_tied_model():
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    (only,) = [build_stage(tied, 2, span) for span in split_layers(tied.n_layers, 1)]
    idx = torch.randint(0, tied.vocab_size, (2, 8))
    assert only.lm_head is None and torch.equal(only(idx), Transformer(tied, seed=2)(idx))
    with pytest.raises(StageError, match="untied"):
        build_stage(tied, 2, split_layers(tied.n_layers, 2)[1])


@pytest.mark.parametrize("layers", [None, [1, 3, 1]])
def test_pipeline_training_equals_single_process_training(layers):
    torch.manual_seed(0)
    steps, per_step, rows = 3, 3, 2
    data = microbatches(steps, per_step, rows)
    reference = Transformer(CFG, seed=11)
    pipelined = copy.deepcopy(reference)

    opt = make_inner_optimizer(reference, OPTIM)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        # gradient accumulation over the microbatches: sums of per-sample gradients, then the mean
        for x, y in batch:
            (reference(x, y) * x.shape[0]).backward()
        total = sum(x.shape[0] for x, _ in batch)
        for p in reference.parameters():
            p.grad.div_(total)
        opt.step()

    spans = split_layers(CFG.n_layers, 3, layers)
    workers = [StageWorker(m, OPTIM, target_samples=per_step * rows) for m in cut(pipelined, spans)]
    steps_taken = []
    for batch in data:
        for x, y in batch:
            # forward through the chain, keeping each stage's inputs (as the driver does)
            inputs = [x]
            for w in workers[:-1]:
                inputs.append(w.forward(inputs[-1]))
            # backward by recomputation, last stage first
            res = workers[-1].backward(inputs[-1], targets=y)
            grad = res.grad_inputs
            for w, inp in zip(reversed(workers[:-1]), reversed(inputs[:-1]), strict=True):
                res_s = w.backward(inp, grad_outputs=grad)
                grad = res_s.grad_inputs
            assert grad is None  # token ids have no gradient
        steps_taken.append([w.stats.optimizer_steps for w in workers])
    assert steps_taken == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    ref = dict(reference.named_parameters())
    for name, p in pipelined.named_parameters():
        assert torch.allclose(p, ref[name], atol=1e-6, rtol=0), (name, (p - ref[name]).abs().max())
    # and the weights did move: the test would catch a pipeline that never steps
    assert not torch.equal(ref["blocks.0.attn.wq.weight"], Transformer(CFG, seed=11).blocks[0].attn.wq.weight)


def test_a_backward_whose_caller_left_changes_nothing():
    (only,) = [build_stage(CFG, 0, span) for span in split_layers(CFG.n_layers, 1)]
    worker = StageWorker(only, OPTIM, target_samples=2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    res = worker.backward(x, targets=x, keep=lambda: False)
    assert not res.kept and worker.stats.samples_accumulated == 0
    assert all(not g.any() for g in worker.grad_sums)
    assert worker.backward(x, targets=x).stepped and worker.stats.optimizer_steps == 1
