"""benchmarks/warm_lr_cpu.py: the same rows from warm starts trained at different lrs, each warm
start's lr said in the JSON and each row's gap taken against its own warm start's DDP."""

import json

import pytest
from _bench_helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("warm_lr_cpu") as module:
        yield module


def test_each_warm_start_gets_its_own_rows_and_gaps(bench, byte_dataset, tmp_path):
    rc = bench.main(["--data", str(byte_dataset.root), "--steps", "4", "--warm-start-steps", "2", "--batch-rows", "2",
                     "--warm-lrs", "1,2", "--jobs", "1", "--results-dir", str(tmp_path), "--warm-dir", str(tmp_path)])
    assert rc == 0
    out = json.loads((tmp_path / "warm_lr_cpu.json").read_text())
    base = bench.cpu.REGIME["base"]["optim"]["lr"]
    assert [w["lr_mult"] for w in out["warm_starts"]] == [1.0, 2.0]
    assert [w["warm_start"]["lr"] for w in out["warm_starts"]] == pytest.approx([base, 2 * base])
    for w in out["warm_starts"]:
        rows = {r["name"]: r for r in w["rows"]}
        assert set(rows) == {"ddp", "outer1-nesterov0.5-int4-H15"}
        assert rows["ddp"]["loss_gap_pct"] == 0.0 and rows["outer1-nesterov0.5-int4-H15"]["loss_gap_pct"] is not None
        assert all(r["inner_lr"] == pytest.approx(bench.ROWS_LR * base) for r in rows.values())
        assert set(w["curves"]) == set(rows)


def test_a_malformed_warm_lr_list_is_refused_in_one_line(bench, capsys):
    assert bench.main(["--warm-lrs", "1,two"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
