"""`murmur sim --speeds`: workers of different speeds on the simulated clock (node/sim/hetero.py),
with the node's own budget rule, weights and DiLoCo code."""

from __future__ import annotations

import json

import pytest
import torch

from murmur.cli import main
from murmur.node.sim.hetero import plan_round, run_hetero
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
