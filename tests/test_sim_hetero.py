"""`murmur sim --speeds`: workers of different speeds on the simulated clock (node/sim/hetero.py),
with the node's own budget rule, weights and DiLoCo code."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from murmur.cli import main
from murmur.node.model.data import BatchLoader, Position
from murmur.node.sim.errors import SimError
from murmur.node.sim.hetero import PooledBatches, plan_round, run_hetero
from murmur.protocol.runconfig import config_from_dict

SPEEDS = [1.0, 1.0, 2.0, 4.0]


def _cfg(rule: str, algorithm: str = "diloco"):
    return config_from_dict({
        "seed": 0,
        "model": {"preset": "tiny", "n_layers": 2, "seq_len": 32},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"batch_size": 2, "eval_batches": 2, "dtype": "fp32"},
        "sync": {"algorithm": algorithm, "inner_steps": 8, "overlap_steps": 1, "fragments": 2,
                 "round_budget": rule},
    })


def test_the_plan_is_the_nodes_rule():
    assert plan_round(_cfg("fixed"), SPEEDS) == [8, 8, 8, 8]
    assert plan_round(_cfg("speed"), SPEEDS) == [12, 12, 6, 3]  # 8 * (1, 1, .5, .25) / .6875


@pytest.mark.parametrize("algorithm", ["diloco", "streaming"])
def test_by_speed_nobody_idles_and_twice_the_tokens_flow(byte_dataset, algorithm):
    runs = {
        rule: run_hetero(_cfg(rule, algorithm), SPEEDS, torch.device("cpu"), byte_dataset, rounds=3,
                         log=lambda _: None)
        for rule in ("fixed", "speed")
    }
    fixed, speed = runs["fixed"], runs["speed"]
    assert fixed.busy == [0.25, 0.25, 0.5, 1.0]  # the slowest is the clock
    assert min(speed.busy) >= 0.9
    assert (speed.tokens / speed.time) >= 1.8 * (fixed.tokens / fixed.time)
    for r in runs.values():
        assert [p.round for p in r.curve] == [0, 1, 2, 3]
        assert r.curve[-1].val_loss < r.curve[0].val_loss


def test_cli_speeds_writes_the_curve_and_refuses_bad_factors(byte_dataset, tmp_path, capsys):
    out = tmp_path / "h"
    base = ["sim", "--data", str(byte_dataset.root), "--device", "cpu", "--set", "model.n_layers=2",
            "--set", "model.seq_len=32", "--set", "train.batch_size=2", "--set", "train.eval_batches=1",
            "-H", "4", "--steps", "8", "--set", "sync.overlap_steps=1"]
    assert main([*base, "--speeds", "1,2", "--set", 'sync.round_budget="speed"', "--out", str(out)]) == 0
    data = json.loads((out / "hetero.json").read_text())
    assert data["rule"] == "speed" and data["steps"] == [[5, 3], [5, 3]] and data["rounds"] == 2
    capsys.readouterr()
    assert main([*base, "--speeds", "1,0.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "at least 1" in err and "\n" not in err


def test_pooled_data_hands_each_round_out_in_worker_order_whatever_the_threads(byte_dataset):
    pool = PooledBatches(byte_dataset, 2, 32, k=2)
    ref = BatchLoader(byte_dataset, list(range(byte_dataset.num_shards)), 2, 32, position=Position(0, 0))
    expected = [next(ref)[0] for _ in range(7)]
    got: dict[tuple[int, int], list[torch.Tensor]] = {}

    def draw(r: int, i: int, n: int) -> None:
        got[r, i] = [x for x, _ in pool.take(r, i, n)]

    # Asked for in reverse order: each waits for its turn (round 0: worker 0 then 1; then round 1).
    threads = [threading.Thread(target=draw, args=a) for a in ((1, 0, 2), (0, 1, 3), (0, 0, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [len(got[key]) for key in ((0, 0), (0, 1), (1, 0))] == [2, 3, 2]
    flat = got[0, 0] + got[0, 1] + got[1, 0]
    assert all(torch.equal(a, b) for a, b in zip(flat, expected, strict=True))


def test_pooled_data_runs_both_rules_and_a_bad_mode_is_refused(byte_dataset):
    for rule in ("fixed", "speed"):
        run = run_hetero(_cfg(rule), SPEEDS, torch.device("cpu"), byte_dataset, rounds=2, data="pooled",
                         log=lambda _: None)
        assert run.tokens == sum(map(sum, run.steps)) * 2 * 32  # every step a batch of the pool
        assert run.curve[-1].val_loss < run.curve[0].val_loss
    with pytest.raises(SimError, match="dealt, pooled"):
        run_hetero(_cfg("speed"), SPEEDS, torch.device("cpu"), byte_dataset, rounds=1, data="shuffled")
