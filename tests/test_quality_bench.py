"""benchmarks/quality.py's bookkeeping: the committed table's gaps and summary come from here."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "quality.py"


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(name, algo, loss, reduction, codec="fp32", h=50):
    return {"name": name, "algo": algo, "codec": codec, "H": h, "val_loss": loss, "loss_gap_pct": None,
            "reduction_vs_ddp": reduction}


def _part(rows):
    return {"command": "c", "rows": rows, "curves": {r["name"]: [] for r in rows}}


def test_merge_computes_gaps_against_the_ddp_row_of_another_part(quality):
    merged = quality.merge_sweeps([
        _part([_row("diloco-int4-H250", "diloco", 3.3, 1777.8, "int4", 250)]),
        _part([_row("ddp", "ddp", 3.0, 1.0), _row("diloco-fp32-H250", "diloco", 3.3, 250.0, h=250)]),
    ])
    assert [r["name"] for r in merged["rows"]] == ["ddp", "diloco-fp32-H250", "diloco-int4-H250"]
    assert [r["loss_gap_pct"] for r in merged["rows"]] == [0.0, 10.0, 10.0]
    s = merged["summary"]
    assert s["best_within_2pct"] is None
    assert s["smallest_gap_at_1000x"]["name"] == "diloco-int4-H250"
    assert s["int4_vs_fp32_H250_pct"] == 0.0


def test_summary_picks_the_largest_reduction_within_2pct(quality):
    rows = [_row("ddp", "ddp", 3.0, 1.0), _row("demo", "demo", 3.03, 31.7), _row("diloco-int4-H50", "diloco", 3.06,
                                                                                   355.6, "int4")]
    for r in rows:
        r["loss_gap_pct"] = round(100 * (r["val_loss"] - 3.0) / 3.0, 2)
    s = quality.summarize(rows)
    assert s["best_within_2pct"] == {"name": "diloco-int4-H50", "reduction_vs_ddp": 355.6, "loss_gap_pct": 2.0}
    assert s["smallest_gap"]["name"] == "demo"
    assert s["smallest_gap_at_1000x"] is None


def test_split_rows_spreads_the_cost_over_lanes(quality):
    names = ["ddp", "demo", "diloco-fp32-H50", "diloco-int4-H50", "diloco-int8-H50"]
    lanes = quality.split_rows(names, 2)
    assert sorted(n for lane in lanes for n in lane) == sorted(names)
    costs = [sum(quality.ROW_COST.get(quality.ROWS[n][0]["algorithm"], 1.0) for n in lane) for lane in lanes]
    assert max(costs) - min(costs) <= 1.0
