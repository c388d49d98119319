"""benchmarks/rounds_cpu.py: DDP and DiLoCo-int4 from one warm start at the rows' lr, with the
gap read off at every evaluated round."""

import json

import pytest
from _bench_helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("rounds_cpu") as module:
        yield module


def test_rows_share_a_warm_start_at_their_lr_and_report_the_gap_by_rounds(bench, byte_dataset, tmp_path,
                                                                         monkeypatch):
    h = bench.cpu.H
    # Two rounds, evaluated after each: gap_by_rounds has a key per round.
    monkeypatch.setitem(bench.cpu.REGIME["base"]["train"], "eval_every", h)
    rc = bench.main(["--data", str(byte_dataset.root), "--steps", str(2 * h), "--warm-start-steps", "2",
                     "--batch-rows", "2", "--jobs", "1", "--results-dir", str(tmp_path), "--warm-dir", str(tmp_path)])
    assert rc == 0
    out = json.loads((tmp_path / "rounds_cpu.json").read_text())
    base = bench.cpu.REGIME["base"]["optim"]["lr"]
    assert out["warm_start"]["lr"] == pytest.approx(bench.warm_lr_cpu.ROWS_LR * base)
    rows = {r["name"]: r for r in out["rows"]}
    diloco = f"outer1-nesterov0.5-int4-H{h}"
    assert set(rows) == {"ddp", diloco} and rows["ddp"]["loss_gap_pct"] == 0.0
    assert all(r["inner_lr"] == pytest.approx(out["warm_start"]["lr"]) for r in rows.values())
    assert out["regime"]["rounds"] == 2 and set(out["gap_by_rounds"]) == {"1", "2"}
    assert out["gap_by_rounds"]["2"][diloco] == pytest.approx(rows[diloco]["loss_gap_pct"], abs=0.01)


def test_fewer_steps_than_a_round_is_refused_in_one_line(bench, capsys):
    assert bench.main(["--steps", "1"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
