"""benchmarks/quality_frontier.py: the rows that no other row beats on traffic and loss together,
over several sections of quality.json, and the issue's targets read off them."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "quality_frontier.py"


def _row(name, gap, reduction, seeds=(0,)):
    return {"name": name, "algo": "ddp" if name == "ddp" else "diloco", "workers": 4, "seeds": list(seeds),
            "loss_gap_pct": gap, "reduction_vs_ddp": reduction}


def _run(path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), "--results", str(path), *args], capture_output=True,
                          text=True, timeout=120)


def test_the_frontier_keeps_undominated_rows_across_sections_and_reads_the_targets(tmp_path):
    doc = {"a": {"rows": [_row("ddp", 0.0, 1.0), _row("int4-H50", 4.4, 356.0, (0, 1)), _row("int4-H250", 8.1, 1778.0),
                          _row("dominated", 9.0, 800.0)]},
           "b": {"rows": [_row("ddp", 0.0, 1.0), _row("int4-H15", 1.9, 106.0), _row("topk-H15", 6.1, 825.0),
                          _row("no-gap-yet", None, 900.0)]},
           "other": {"rows": [_row("not-read", 0.1, 5000.0)]}}
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(doc))
    done = _run(path, "--sections", "a,b", "--name", "front")
    assert done.returncode == 0, done.stderr
    out = json.loads(path.read_text())
    assert out["a"] == doc["a"] and out["other"] == doc["other"]  # only the new section is written
    front = out["front"]
    assert [p["row"] for p in front["frontier"]] == ["int4-H15", "int4-H50", "topk-H15", "int4-H250"]
    assert {p["row"] for p in front["points"]} == {"int4-H15", "int4-H50", "topk-H15", "int4-H250", "dominated"}
    s = front["summary"]
    assert s["best_within_3pct"]["row"] == "int4-H15" and s["best_within_2pct"]["row"] == "int4-H15"
    assert s["smallest_gap_at_250x"]["row"] == "int4-H50" and s["smallest_gap_at_250x"]["section"] == "a"
    assert s["smallest_gap_at_1000x"]["row"] == "int4-H250"
    assert s["targets_met"] == {">=1000x within 3%": False, ">=250x within 2%": False}
    assert (tmp_path / "quality-front.png").stat().st_size > 0


def test_a_section_that_is_not_there_is_refused_in_one_line(tmp_path):
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({"a": {"rows": []}}))
    done = _run(path, "--sections", "a,typo", "--name", "front")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {path} has no quality.py section typo"]
    assert "front" not in json.loads(path.read_text())
