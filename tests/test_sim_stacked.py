"""The simulator's stacked engine (one vmapped step for K replicas) against the threads engine
(a module and a thread per replica): the same optim code on the same data must give the same
weights, losses and byte counts, up to float rounding, for every algorithm."""

from __future__ import annotations

import pytest
import torch

from murmur.node.model.data import Dataset
from murmur.node.sim.replicas import SimError, worker_loaders
from murmur.node.sim.run import run_sim
from murmur.node.sim.stacked import StackedReplicas
from murmur.protocol.runconfig import config_from_dict

CPU = torch.device("cpu")


def tiny_cfg(root, algorithm: str, **sync) -> object:
    return config_from_dict({
        "seed": 3,
        "model": {"preset": "tiny", "n_layers": 2, "seq_len": 32},
        "data": {"path": str(root)},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5},
        "train": {"batch_size": 2, "steps": 6, "eval_every": 3, "eval_batches": 2},
        "sync": {"algorithm": algorithm, "inner_steps": 3, "overlap_steps": 0, **sync},
    })


CASES = [
    ("ddp", {}),
    ("diloco", {"codec": "int8"}),
    ("streaming", {"codec": "fp16", "fragments": 2, "overlap_steps": 1, "mix_alpha": 0.5}),
    ("demo", {"demo_topk": 4, "demo_chunk": 16}),
    ("diloco", {"codec": "topk2bit", "topk_fraction": 0.05}),
]


@pytest.mark.parametrize("algorithm,sync", CASES, ids=[f"{a}-{s.get('codec', '')}" for a, s in CASES])
def test_stacked_engine_matches_threads(byte_dataset, algorithm, sync):
    cfg = tiny_cfg(byte_dataset.root, algorithm, **sync)
    ds = Dataset.open(byte_dataset.root)
    a = run_sim(cfg, 3, CPU, ds, engine="threads", log=lambda s: None)
    b = run_sim(cfg, 3, CPU, ds, engine="stacked", log=lambda s: None)
    assert a.engine == "threads" and b.engine == "stacked"
    assert b.bytes_per_worker == a.bytes_per_worker > 0
    assert b.bytes_by_codec == a.bytes_by_codec
    assert [p.step for p in b.curve] == [p.step for p in a.curve] == [0, 3, 6]
    for pa, pb in zip(a.curve, b.curve, strict=True):
        assert pb.val_loss == pytest.approx(pa.val_loss, abs=2e-5), (pa, pb)
    # Training moved the weights: the comparison above is not between two untouched models.
    assert b.curve[-1].val_loss < b.curve[0].val_loss


def test_stacked_replicas_are_independent_and_clipped_per_replica(byte_dataset):
    """Each replica trains on its own data; clipping one replica's large gradient leaves the
    others' alone (one global norm over the stack would couple them)."""
    cfg = tiny_cfg(byte_dataset.root, "diloco", codec="fp32")
    ds = Dataset.open(byte_dataset.root)
    reps = StackedReplicas(cfg, 2, CPU, worker_loaders(ds, 2, 32), ds.vocab_size, ["a", "b"])
    try:
        name = reps.names[0]
        reps.stacked[name].grad = torch.zeros_like(reps.stacked[name])
        reps.stacked[name].grad[0].fill_(10.0)  # replica 0: far beyond the clip norm
        reps.stacked[name].grad[1].fill_(1e-4)  # replica 1: well inside it
        reps._clip(0.5)
        g = reps.stacked[name].grad
        assert g[0].norm().item() == pytest.approx(0.5, rel=1e-4)
        assert torch.all(g[1] == 1e-4)
        reps.stacked[name].grad = None
        losses = reps.step(0, 6)
        assert losses.shape == (2,) and losses[0] != losses[1]  # different shards, different losses
    finally:
        reps.close()


def test_unknown_engine_is_one_line(byte_dataset):
    cfg = tiny_cfg(byte_dataset.root, "diloco")
    with pytest.raises(SimError, match="engine must be one of stacked, threads"):
        run_sim(cfg, 2, CPU, Dataset.open(byte_dataset.root), engine="gpu", log=lambda s: None)


def test_both_engines_continue_from_a_checkpoints_weights_and_adamw_state(byte_dataset, tmp_path):
    """`--init-from` a `murmur train` checkpoint: every replica of either engine holds its weights
    and its AdamW moments, each replica its own copy, and the two engines then agree."""
    from murmur.node.sim.replicas import read_warm_start
    from murmur.node.sim.threaded import build_workers
    from murmur.node.train.trainer import Trainer

    cfg = tiny_cfg(byte_dataset.root, "diloco", codec="fp32")
    ds = Dataset.open(byte_dataset.root)
    trainer = Trainer(cfg, ds, CPU)
    for _ in range(3):
        trainer.step()
    trainer.save(tmp_path / "ckpt.pt")
    init = read_warm_start(tmp_path / "ckpt.pt")
    assert init.optimizer is not None
    want = trainer.opt.state[trainer.model.embed.weight]["exp_avg_sq"]

    reps = StackedReplicas(cfg, 2, CPU, worker_loaders(ds, 2, 32), ds.vocab_size, ["a", "b"], init)
    try:
        got = reps.opt.state[reps.stacked["embed.weight"]]["exp_avg_sq"]
        assert got.shape == (2, *want.shape) and torch.equal(got[0], want) and torch.equal(got[1], want)
        assert torch.equal(reps.stacked["embed.weight"][1].detach(), trainer.model.embed.weight.detach())
    finally:
        reps.close()
    workers, _ = build_workers(cfg, 2, CPU, worker_loaders(ds, 2, 32), ds.vocab_size, init)
    states = [w.opt.state[w.model.embed.weight]["exp_avg_sq"] for w in workers]
    assert torch.equal(states[0], want) and states[0].data_ptr() != states[1].data_ptr()

    a = run_sim(cfg, 2, CPU, ds, engine="threads", init=init, log=lambda s: None)
    b = run_sim(cfg, 2, CPU, ds, engine="stacked", init=init, log=lambda s: None)
    assert a.curve[0].val_loss == pytest.approx(trainer.validate(), abs=1e-4)  # starts where training stopped
    for pa, pb in zip(a.curve, b.curve, strict=True):
        assert pb.val_loss == pytest.approx(pa.val_loss, abs=2e-5), (pa, pb)


def test_a_warm_start_optimizer_of_another_model_is_one_error(byte_dataset, tmp_path):
    from murmur.node.sim.replicas import WarmStart

    cfg = tiny_cfg(byte_dataset.root, "diloco", codec="fp32")
    ds = Dataset.open(byte_dataset.root)
    probe = StackedReplicas(cfg, 1, CPU, worker_loaders(ds, 1, 32), ds.vocab_size, ["a"])
    weights = {n: p.detach()[0].clone() for n, p in probe.stacked.items()}
    probe.close()
    bad = WarmStart(weights, {"state": {}, "param_groups": [{"params": [0, 1]}]})
    with pytest.raises(SimError, match="optimizer state does not fit the configured model: the saved optimizer has 2"):
        run_sim(cfg, 2, CPU, ds, init=bad, log=lambda s: None)


@pytest.mark.parametrize("engine", ["stacked", "threads"])
def test_every_algorithm_evaluates_where_asked_and_ends_on_the_synced_model(byte_dataset, engine):
    """DDP is evaluated at train.eval_every, not at multiples of H; a DiLoCo run of 5 steps with
    H = 3 ends with a last sync (2 rounds), and its final evaluation is of that global model."""
    ds = Dataset.open(byte_dataset.root)
    ddp = tiny_cfg(byte_dataset.root, "ddp")
    ddp.sync.inner_steps, ddp.train.eval_every, ddp.train.steps = 4, 3, 5
    r = run_sim(ddp, 2, CPU, ds, engine=engine, log=lambda s: None)
    assert [p.step for p in r.curve] == [0, 3, 5]
    cfg = tiny_cfg(byte_dataset.root, "diloco", codec="fp32")
    cfg.train.steps, cfg.train.eval_every = 5, 2
    r = run_sim(cfg, 2, CPU, ds, engine=engine, log=lambda s: None)
    assert [p.step for p in r.curve] == [0, 2, 4, 5]
    per_round = 2 * (2 - 1) * 4 * r.n_params // 2
    assert r.bytes_per_worker == 2 * per_round  # the sync after step 3, and the last one after step 5
    assert r.curve[1].bytes_sent == 0  # step 2: evaluated before any sync, the initial global model
    assert r.curve[1].val_loss == pytest.approx(r.curve[0].val_loss, abs=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_warm_starts_adamw_step_is_placed_as_the_optimizer_needs(fused):
    """A warm start is read onto the CPU. Fused (or capturable) AdamW wants ``step`` as a float32
    tensor beside its parameter (on a GPU it refused a CPU step: the quality run on the H200
    failed at its first step); the for-loop and foreach AdamW keep it on the CPU."""
    from murmur.node.sim.replicas import placed_adamw_state

    p = torch.zeros(3, 4)
    saved = {"step": torch.tensor(7.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.full((4,), 2.0)}
    placed = placed_adamw_state(saved, p, {"fused": fused}, k=3)
    assert placed["step"].dtype == torch.float32 and float(placed["step"]) == 7.0
    assert placed["exp_avg"].shape == (3, 4) and torch.equal(placed["exp_avg_sq"][2], saved["exp_avg_sq"])
    placed["exp_avg"][0].add_(1)  # copies: one replica's update leaves the others and the saved state
    assert torch.equal(placed["exp_avg"][1], saved["exp_avg"]) and torch.equal(saved["exp_avg"], torch.ones(4))
    opt = torch.optim.AdamW([p.requires_grad_()], lr=0.1, fused=fused)
    opt.state[p] = placed
    p.grad = torch.ones(3, 4)
    opt.step()
    assert float(opt.state[p]["step"]) == 8.0


def test_the_compiled_stacked_step_trains_as_the_eager_one(byte_dataset, monkeypatch):
    """`murmur sim --compile on` (auto: on CUDA) runs the vmapped step through torch.compile. On
    the CPU it must train the replicas as the eager step does: same losses, same bytes."""
    cfg = tiny_cfg(byte_dataset.root, "diloco", codec="int8")
    cfg.model.n_layers = 1
    cfg.train.steps = 4
    ds = Dataset.open(byte_dataset.root)
    monkeypatch.setenv("MURMUR_COMPILE", "off")
    eager = run_sim(cfg, 2, CPU, ds, engine="stacked", log=lambda s: None)
    monkeypatch.setenv("MURMUR_COMPILE", "on")
    compiled = run_sim(cfg, 2, CPU, ds, engine="stacked", log=lambda s: None)
    assert (eager.engine, compiled.engine) == ("stacked", "stacked+compile")
    assert compiled.bytes_per_worker == eager.bytes_per_worker > 0
    for a, b in zip(eager.curve, compiled.curve, strict=True):
        assert b.val_loss == pytest.approx(a.val_loss, abs=1e-4), (a, b)
    assert compiled.curve[-1].val_loss < compiled.curve[0].val_loss
