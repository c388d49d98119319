"""The pipelined run's schedule in ledger samples, and how a driver cuts a lease into microbatches."""

from __future__ import annotations

import pytest

from murmur.node.pipeline.driver_process import lease_plan
from murmur.node.pipeline.schedule import RunSchedule
from murmur.optim.inner import lr_at
from murmur.protocol.runconfig import load_config


def schedule() -> RunSchedule:
    run = load_config("configs/testnet-tiny.toml", ["train.steps=100", "train.batch_size=8", "train.eval_every=10",
                                                    "optim.warmup_steps=5", "optim.min_lr_ratio=0.1"])
    return RunSchedule.of(run, seq_len=64)


def test_the_run_step_and_lr_follow_the_ledger_total_the_same_for_every_stage():
    s = schedule()
    assert s.budget_tokens == 100 * 8 * 64 and s.step == 0 and not s.done
    assert s.lr() == pytest.approx(lr_at(0, 100, s.optim))  # warm-up's first step
    s.heard(40 * 8 * 64 + 63)  # 40 steps and a partial sequence
    assert s.step == 40 and s.lr() == pytest.approx(lr_at(40, 100, s.optim))
    s.heard(10)  # a stale reply never takes the progress back
    assert s.step == 40
    s.heard(s.budget_tokens)
    assert s.done and s.lr() == pytest.approx(s.optim.lr * s.optim.min_lr_ratio)


def test_an_evaluation_is_due_when_the_ledger_crosses_eval_every_steps_or_the_end():
    s = schedule()
    step = 8 * 64  # tokens of one run step
    assert not s.evaluation_due(0, 9 * step)
    assert s.evaluation_due(9 * step, 10 * step)
    assert not s.evaluation_due(10 * step, 11 * step)
    assert s.evaluation_due(95 * step, 101 * step)  # the schedule's end


def test_a_lease_is_cut_into_whole_sequences_and_its_tail_goes_with_the_last_microbatch():
    plan = lease_plan(1000, 1000 + 3 * 256 + 2 * 64 + 30, rows=4, seq_len=64)
    assert [(o, r) for o, r, _ in plan] == [(1000, 4), (1256, 4), (1512, 4), (1768, 2)]
    assert [e for _, _, e in plan] == [1256, 1512, 1768, 1000 + 3 * 256 + 2 * 64 + 30]
    # contiguous: every commit starts where the one before ended
    assert all(plan[i][2] == plan[i + 1][0] for i in range(len(plan) - 1))
    assert lease_plan(0, 64, rows=4, seq_len=64) == []  # less than one sequence and its target
    assert lease_plan(0, 65, rows=4, seq_len=64) == [(0, 1, 65)]


def test_a_stage_worker_steps_at_the_lr_the_schedule_gives_at_each_step():
    import torch

    from murmur.node.model.stages import build_stage, split_layers
    from murmur.node.model.transformer import model_config
    from murmur.node.pipeline.worker import StageWorker
    from murmur.protocol.runconfig import OptimSection

    cfg = model_config("tiny", n_layers=1, dim=32, hidden_dim=64, seq_len=16)
    (span,) = split_layers(1, 1)
    worker = StageWorker(build_stage(cfg, 0, span), OptimSection(lr=1e-3, warmup_steps=0), target_samples=2)
    s = schedule()
    worker.lr_now = s.lr
    seen = []
    worker.on_step = lambda: seen.append(worker.optimizer.param_groups[0]["lr"])
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    for tokens in (0, 50 * 8 * 64, 100 * 8 * 64):  # the ledger's total moves between the steps
        s.heard(tokens)
        worker.backward(x, targets=x)
    assert seen == pytest.approx([lr_at(0, 100, s.optim), lr_at(50, 100, s.optim), lr_at(100, 100, s.optim)])
