"""optim.inner = "muon" (MuLoCo's inner optimizer): Muon steps the blocks' 2-D matrices exactly as
torch.optim.Muon does, AdamW the embedding, head and norms; `murmur train` resumes a Muon run bit for
bit; both simulator engines run it (the stacked one as K batched Muons) and a warm start's AdamW
state seeds it; a config that cannot work is refused in one line."""

from __future__ import annotations

import pytest
import torch

from murmur.node.sim.replicas import WarmStart, build_replica_model
from murmur.node.sim.run import run_sim
from murmur.node.sim.stacked import StackedReplicas
from murmur.node.train.trainer import Trainer
from murmur.optim.inner import make_inner_optimizer, saved_inner_state, set_lr
from murmur.optim.muon import MuonAdamW, newton_schulz
from murmur.protocol.runconfig import ConfigError, OptimSection, config_from_dict

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(data_path, steps=8, optim=None, sync=None, **train):
    return config_from_dict({
        "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "hidden_dim": 128,
                  "seq_len": 32},
        "data": {"path": str(data_path)},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "inner": "muon", "muon_lr": 3e-3, **(optim or {})},
        "train": {"steps": steps, "batch_size": 4, "eval_batches": 1, "eval_every": 1000, "dtype": "fp32", **train},
        "sync": {"overlap_steps": 0, **(sync or {})},
    })


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_the_muon_update_is_torch_optim_muon_bit_for_bit(rule, shape):
    cfg = OptimSection(inner="muon", lr=1e-3, muon_lr=0.02, muon_weight_decay=0.1, muon_adjust_lr=rule)
    gen = torch.Generator().manual_seed(0)
    ours_w = torch.nn.Parameter(torch.randn(shape, generator=gen))
    ref_w = torch.nn.Parameter(ours_w.detach().clone())
    ours = MuonAdamW([ours_w], torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), cfg)
    set_lr(ours, 1e-3)  # the schedule's lr: Muon's group runs at muon_lr (its lr_ratio)
    ref = torch.optim.Muon([ref_w], lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn=rule)
    for _ in range(4):
        g = torch.randn(shape, generator=gen)
        ours_w.grad, ref_w.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(ours_w, ref_w)


def test_stacked_matrices_are_orthogonalised_one_by_one():
    x = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(1))
    each = torch.stack([newton_schulz(m) for m in x])
    assert torch.allclose(newton_schulz(x).float(), each.float(), atol=1e-2)  # bf16 iterations


def test_matrices_go_through_muon_and_the_rest_through_adamw(byte_dataset):
    model = build_replica_model(_cfg(byte_dataset.root), byte_dataset.vocab_size, CPU)
    opt = make_inner_optimizer(model, _cfg(byte_dataset.root).optim)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {g["kind"]: [names[id(p)] for p in g["params"]] for g in opt.param_groups if g["kind"] == "muon"}
    adamw = [names[id(p)] for g in opt.param_groups if g["kind"] == "adamw" for p in g["params"]]
    muon = kinds["muon"]
    assert muon and all(n.startswith("blocks.") and model.get_parameter(n).dim() == 2 for n in muon)
    assert len(muon) == sum(1 for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2)
    assert "embed.weight" in adamw and all(model.get_parameter(n).dim() == 1 or "embed" in n or "lm_head" in n
                                           for n in adamw)
    assert sorted(muon + adamw) == sorted(names.values())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, byte_dataset.vocab_size, (2, 32))
    model(x, x).backward()
    set_lr(opt, 3e-3)
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())  # every tensor moved
    assert all(set(opt.state[model.get_parameter(n)]) == {"momentum_buffer"} for n in muon)
    assert all({"exp_avg", "exp_avg_sq"} <= set(opt.state[model.get_parameter(n)]) for n in adamw)


def test_a_resumed_muon_run_continues_bit_for_bit(byte_dataset, tmp_path):
    cfg = _cfg(byte_dataset.root, steps=8)
    straight = Trainer(cfg, byte_dataset, CPU)
    expected = [straight.step().loss for _ in range(8)]
    first = Trainer(cfg, byte_dataset, CPU)
    got = [first.step().loss for _ in range(4)]
    first.save(tmp_path / "ckpt.pt")
    second = Trainer(cfg, byte_dataset, CPU)
    second.load(tmp_path / "ckpt.pt")
    got += [second.step().loss for _ in range(4)]
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), second.model.parameters(), strict=True))


def test_an_adamw_checkpoint_does_not_load_into_muon(byte_dataset, tmp_path):
    adamw = Trainer(_cfg(byte_dataset.root, optim={"inner": "adamw"}), byte_dataset, CPU)
    adamw.step()
    muon = Trainer(_cfg(byte_dataset.root), byte_dataset, CPU)
    with pytest.raises(ValueError, match="another optim.inner"):
        muon.opt.load_state_dict(adamw.opt.state_dict())


@pytest.mark.parametrize("algorithm", ["ddp", "diloco"])
def test_both_engines_train_muon_replicas_alike(byte_dataset, algorithm):
    cfg = _cfg(byte_dataset.root, steps=4, sync={"algorithm": algorithm, "inner_steps": 2})
    stacked = run_sim(cfg, 2, CPU, byte_dataset, engine="stacked", log=lambda s: None)
    threads = run_sim(cfg, 2, CPU, byte_dataset, engine="threads", log=lambda s: None)
    assert abs(stacked.val_loss - threads.val_loss) < 1e-3, (stacked.val_loss,
                                                                         threads.val_loss)


def test_an_adamw_warm_start_seeds_muon_momentum_from_its_first_moment(byte_dataset):
    warm = Trainer(_cfg(byte_dataset.root, optim={"inner": "adamw"}), byte_dataset, CPU)
    warm.step()
    init = WarmStart(warm.model.state_dict(), warm.opt.state_dict())
    cfg = _cfg(byte_dataset.root, steps=2, sync={"algorithm": "diloco", "inner_steps": 2})
    named = list(warm.model.named_parameters())
    saved = saved_inner_state(init.optimizer, [(n, p.shape) for n, p in named])
    reps = StackedReplicas(cfg, 2, CPU, lambda i, k: iter(()), byte_dataset.vocab_size, ["a", "b"], init)
    try:
        for group in reps.opt.param_groups:
            for t in group["params"]:
                name = next(n for n, s in reps.stacked.items() if s is t)
                st = reps.opt.state[t]
                if group["kind"] == "muon":
                    assert torch.equal(st["momentum_buffer"][1], saved[name]["exp_avg"])
                else:
                    assert torch.equal(st["exp_avg_sq"][0], saved[name]["exp_avg_sq"])
    finally:
        reps.close()


def test_muon_with_demo_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"optim": {"inner": "muon"}, "sync": {"algorithm": "demo"}})
    assert "optim.inner" in str(err.value) and "demo" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="optim.inner"):
        config_from_dict({"optim": {"inner": "lion"}})


def test_stage_workers_step_their_blocks_with_muon_and_reload_its_state():
    from murmur.node.model.stages import build_stage, split_layers
    from murmur.node.model.transformer import ModelConfig
    from murmur.node.pipeline.worker import StageWorker

    model = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, seq_len=16,
                        tie_embeddings=False)
    optim = OptimSection(inner="muon", lr=1e-2, muon_lr=1e-2, warmup_steps=0)
    spans = split_layers(model.n_layers, 2, None)
    workers = [StageWorker(build_stage(model, 5, sp), optim, target_samples=2) for sp in spans]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = (torch.randint(0, 256, (2, model.seq_len), generator=g) for _ in range(2))
        res = workers[1].backward(workers[0].forward(x), targets=y)
        workers[0].backward(x, grad_outputs=res.grad_inputs)
    for w in workers:
        assert w.stats.optimizer_steps == 2
        names = {id(p): n for n, p in w.module.named_stage_parameters()}
        by_kind = {g["kind"]: {names[id(p)] for p in g["params"]} for g in w.optimizer.param_groups}
        assert by_kind["muon"] and all(n.startswith("blocks.") for n in by_kind["muon"])
        assert not by_kind["muon"] & {"embed.weight", "lm_head.weight"}
        fresh = StageWorker(build_stage(model, 5, w.span), optim, target_samples=2)
        fresh.optimizer.load_state_dict(w.optimizer.state_dict())
        for a, b in zip(fresh.params, w.params, strict=True):
            for key, v in w.optimizer.state[b].items():
                assert torch.equal(fresh.optimizer.state[a][key], v)
