"""benchmarks/sparseloco_cpu.py: sections of rows at a per-worker batch each, the gap by rounds read
off the curves, and the 2-bit coding's error measured on real error-feedback buffers."""

import json

import pytest
from _bench_helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("sparseloco_cpu") as module:
        yield module


def test_sections_write_rows_gaps_by_round_and_the_coding_error(bench, byte_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "H", 2)
    monkeypatch.setitem(bench.REGIME["base"]["train"], "eval_every", 2)
    rc = bench.main(["--data", str(byte_dataset.root), "--sections", "2x4,4x2", "--warm-start-steps", "2",
                     "--rows", "ddp,sparseloco-senders-H15", "--jobs", "1", "--results-dir", str(tmp_path),
                     "--warm-dir", str(tmp_path)])
    assert rc == 0
    out = json.loads((tmp_path / "sparseloco_cpu.json").read_text())
    assert [(s["per_worker_batch_tokens"], s["rounds"]) for s in out["sections"]] == [(256, 2), (512, 1)]
    first = out["sections"][0]
    assert {r["name"] for r in first["rows"]} == {"ddp", "sparseloco-senders-H15"}
    assert set(first["gap_by_rounds"]) == {"1", "2"}
    errors = out["quantizer"]["relative_l2_error_per_round"]
    assert len(errors["ours"]) == len(errors["paper"]) == out["quantizer"]["rounds"]
    assert all(0 < e < 1 for e in errors["ours"] + errors["paper"])


def test_a_malformed_section_is_refused_in_one_line(bench, capsys):
    assert bench.main(["--sections", "64by300"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
