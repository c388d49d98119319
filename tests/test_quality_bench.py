"""benchmarks/quality.py: the rows of the regime, named for what they run; the smoke run's JSON
(the schema the committed table uses, the warm start's loss on the rows' own validation set,
the gap-vs-batch curve, the old table kept); the summary and the merge of calls."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "quality.py"
ROW_KEYS = {"name", "algo", "codec", "H", "workers", "per_worker_batch_tokens", "tokens", "inner_lr", "outer", "seeds",
            "val_loss_mean", "val_loss_spread", "loss_gap_pct", "bytes_per_worker", "reduction_vs_ddp"}


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_the_full_regime_has_the_rows_the_issue_asks_for(quality):
    rows = quality.build_rows(quality.FULL, smoke=False)
    names = [r.name for r in rows]
    assert len(names) == len(set(names))
    assert {r.sync["inner_steps"] for r in rows if r.sync["algorithm"] == "diloco"} >= {25, 50, 100, 250}
    assert quality.FULL["workers"] == 4 and quality.FULL["base"]["train"]["batch_size"] * 256 == 8192
    by = {r.name: r for r in rows}
    assert by["single-worker"].workers == 1
    ddp_lrs = sorted(v["optim.lr"] for v in by["ddp"].variants)
    assert ddp_lrs[0] < 1 < ddp_lrs[-1]  # swept down and up
    inner_lrs = sorted(v["optim.lr"] for v in by["avg-fp32-H50"].variants)
    assert inner_lrs[0] < 1 < inner_lrs[-1]
    # Named for what they run: "avg" is plain averaging, "nesterov0.7m0.9" DiLoCo's published step.
    for r in rows:
        cfg = quality.row_config(quality.FULL, r, r.variants[0], "d", 1000, 0)
        outer = quality.describe_outer(cfg.sync)
        if r.name.startswith("avg-") or r.name.startswith("sparseloco") and not r.name.startswith(
                ("sparseloco-senders-knobs", "sparseloco-members-outer-lrK")):
            assert outer == "averaging", r.name
        if r.name.startswith("nesterov0.7m0.9"):
            assert outer == "lr 0.7, nesterov 0.9", r.name
    assert quality.FULL["batch_tokens"] == (2048, 8192, 32768, 65536)


def test_the_outer_steps_run_with_int4_and_the_outer_lr_sweep_crosses_the_inner_lr(quality):
    """DiLoCo's Nesterov step and lr 1 + Nesterov 0.5 with int4 updates at every H (the codec of the
    traffic targets), and the outer-lr sweep under Nesterov 0.9 at each outer lr x each inner lr."""
    by = {r.name: r for r in quality.build_rows(quality.FULL, smoke=False)}
    for h in (25, 50, 100, 250):
        for name, outer in ((f"nesterov0.7m0.9-int4-H{h}", "lr 0.7, nesterov 0.9"),
                            (f"outer1-nesterov0.5-int4-H{h}", "lr 1, nesterov 0.5")):
            cfg = quality.row_config(quality.FULL, by[name], by[name].variants[0], "d", 1000, 0)
            assert (cfg.sync.codec, cfg.sync.inner_steps, quality.describe_outer(cfg.sync)) == ("int4", h, outer)
    sweep = by["outer-lr-sweep-nesterov0.9-int4-H50"]
    assert len(sweep.variants) == len(quality.FULL["outer_sweep"]) * len(quality.FULL["short_sweep"])
    cfg = quality.row_config(quality.FULL, sweep, {"sync.outer_lr": 0.4, "optim.lr": 2.0}, "d", 1000, 0)
    assert (cfg.sync.codec, cfg.sync.outer_lr, cfg.sync.outer_momentum, cfg.optim.lr) == ("int4", 0.4, 0.9, 2e-3)
    assert quality.describe_outer(cfg.sync) == "lr 0.4, nesterov 0.9"
    # The 32k regime's outer lr sweep at its largest H keeps DiLoCo-int4's Nesterov 0.5.
    wide = {r.name: r for r in quality.build_rows(quality.FULL_32K, False)}["outer-lr-sweep-nesterov0.5-int4-H250"]
    cfg = quality.row_config(quality.FULL_32K, wide, {"sync.outer_lr": 2.0, "optim.lr": 4.0}, "d", 1000, 0)
    assert (cfg.sync.inner_steps, cfg.sync.outer_lr, cfg.sync.outer_momentum, cfg.optim.lr) == (250, 2.0, 0.5, 4e-3)


def test_smoke_run_writes_the_table(quality, byte_dataset, tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [{"name": "ddp", "val_loss": 3.27}], "workers": 8}))
    out = tmp_path / "res"
    rc = quality.main(["--smoke", "--data", str(byte_dataset.root), "--results-dir", str(out), "--old-table", str(old),
                       "--warm-dir", str(tmp_path), "--rows", "ddp,single-worker,avg-fp32-H2,avg-int4-H2"])
    assert rc == 0
    data = json.loads((out / "quality.json").read_text())
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"
    assert data["old_table"] == json.loads(old.read_text())
    assert data["init"]["path"].endswith("warm-smoke.pt") and len(data["init"]["sha256"]) == 64
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["ddp", "single-worker", "avg-fp32-H2", "avg-int4-H2"]
    for r in rows.values():
        assert ROW_KEYS <= set(r), r["name"]
        assert r["seeds"] == [0, 1] and r["val_loss_spread"] >= 0
        # Every row starts from the warm start, evaluated on the same batches as the rows.
        assert data["curves"][r["name"]][0][3] == data["warm_start"]["val_loss"], r["name"]
    assert rows["ddp"]["loss_gap_pct"] == 0.0 and rows["ddp"]["reduction_vs_ddp"] == 1.0
    assert rows["ddp"]["val_loss_mean"] == min(v["val_loss_mean"] for v in rows["ddp"]["variants"])
    assert rows["single-worker"]["workers"] == 1 and rows["single-worker"]["bytes_per_worker"] == 0
    assert rows["avg-fp32-H2"]["outer"] == "averaging" and rows["avg-fp32-H2"]["reduction_vs_ddp"] > 1
    curve = data["gap_vs_batch"]
    assert [p["per_worker_batch_tokens"] for p in curve] == [64, 128]
    assert {p["row"] for p in curve} <= {"avg-fp32-H2", "avg-int4-H2"}
    # Equal tokens: twice the batch, half the steps.
    assert curve[0]["steps"] == 2 * curve[1]["steps"]


def test_the_curve_runs_alone_for_a_named_row_at_chosen_batches(quality, byte_dataset, tmp_path):
    """--curve-row: only the gap-vs-batch points asked for (a GPU call's budget fits one point),
    DDP and the row each at the first --sweep multiple; a row that does not exist is refused."""
    out = tmp_path / "res"
    common = ["--smoke", "--data", str(byte_dataset.root), "--results-dir", str(out), "--old-table", "",
              "--warm-dir", str(tmp_path), "--seeds", "1", "--sweep", "2"]
    assert quality.main(common + ["--curve-row", "avg-int4-H2", "--curve-batches", "64"]) == 0
    data = json.loads((out / "quality.json").read_text())
    assert data["rows"] == []
    [point] = data["gap_vs_batch"]
    assert (point["row"], point["per_worker_batch_tokens"], point["steps"]) == ("avg-int4-H2", 64, 4)
    assert point["reduction_vs_ddp"] > 1 and point["ddp_val_loss"] != point["row_val_loss"]
    assert quality.main(common + ["--curve-row", "no-such-row"]) == 2


def _row(name, loss, reduction, h=50):
    return {"name": name, "algo": "ddp" if name == "ddp" else "diloco", "H": h, "val_loss_mean": loss,
            "loss_gap_pct": None, "reduction_vs_ddp": reduction}


def test_summary_picks_the_largest_reduction_within_3_and_5_pct(quality):
    rows = [_row("ddp", 3.0, 1.0), _row("avg-fp32-H50", 3.06, 355.6), _row("avg-int4-H50", 3.12, 1422.0),
            _row("avg-int4-H250", 3.3, 7000.0, 250)]
    quality.add_gaps(rows)
    s = quality.summarize(rows)
    assert s["best_within_3pct"] == {"name": "avg-fp32-H50", "reduction_vs_ddp": 355.6, "loss_gap_pct": 2.0}
    assert s["best_within_5pct"]["name"] == "avg-int4-H50"
    assert s["smallest_gap_at_1000x"]["name"] == "avg-int4-H50"
    assert s["int4_vs_fp32_H50_pct"] == pytest.approx(1.96)


POINT = {"per_worker_batch_tokens": 8192, "loss_gap_pct": 4.0, "row": "avg-fp32-H50"}


def test_combine_joins_calls_and_recomputes_gaps(quality, tmp_path):
    a = {"command": "a", "rows": [_row("avg-fp32-H50", 3.3, 250.0)], "curves": {"avg-fp32-H50": []}}
    b = {"command": "b", "rows": [_row("ddp", 3.0, 1.0)], "curves": {"ddp": []}, "gap_vs_batch": [POINT]}
    for name, part in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(part))
    merged = quality.combine([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out")
    assert [r["loss_gap_pct"] for r in merged["rows"]] == [10.0, 0.0]
    assert merged["gap_vs_batch"] == [POINT] and merged["command"] == "a ; b"
    assert json.loads((tmp_path / "out" / "quality.json").read_text())["summary"] == merged["summary"]


def test_combine_keeps_the_best_of_a_row_run_by_several_calls_with_every_variant(quality, tmp_path):
    """Two calls swept DDP's lr over different values: one row, at the best, listing all four."""
    def ddp(loss, mults):
        return {**_row("ddp", loss, 1.0), "variants": [{"variant": {"optim.lr": m}, "val_loss_mean": loss + i / 10}
                                                        for i, m in enumerate(mults)]}

    a = {"command": "a", "warm_start": {"val_loss": 3.41}, "rows": [ddp(2.76, (2.0, 1.0)), _row("avg", 3.0, 350.0)],
         "curves": {"ddp": [[0, 0, 0, 3.41]], "avg": []}}
    b = {"command": "b", "warm_start": None, "init": {"path": "w.pt", "sha256": "ab"}, "rows": [ddp(2.77, (4.0, 8.0))],
         "curves": {"ddp": [[0, 0, 0, 3.39]]}}
    for name, part in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(part))
    merged = quality.combine([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out")
    rows = {r["name"]: r for r in merged["rows"]}
    assert list(rows) == ["ddp", "avg"]
    assert rows["ddp"]["val_loss_mean"] == 2.76 and merged["curves"]["ddp"] == [[0, 0, 0, 3.41]]
    assert [v["variant"]["optim.lr"] for v in rows["ddp"]["variants"]] == [2.0, 1.0, 4.0, 8.0]
    assert rows["avg"]["loss_gap_pct"] == pytest.approx(8.7, abs=0.01)
    assert [p["rows"] for p in merged["parts"]] == [["ddp", "avg"], ["ddp"]]
    assert [p["init"] for p in merged["parts"]] == [None, {"path": "w.pt", "sha256": "ab"}]
    assert merged["warm_start"] == {"val_loss": 3.41}


def test_the_32k_regime_keeps_h_and_the_warm_start_and_sweeps_ddp_around_its_winner(quality):
    """Issue 39's regime: 128 x 256 tokens per worker-step, H in {50, 125, 250} (not scaled down
    with the batch), the 8k regime's warm start (same batch, same steps), DDP's lr over three values."""
    r32 = quality.REGIMES["32k"]
    assert r32["base"]["train"]["batch_size"] * r32["base"]["model"]["seq_len"] == 32768
    assert r32["warm_batch"] == quality.FULL["workers"] * quality.FULL["base"]["train"]["batch_size"]
    assert quality.FULL["base"]["train"]["batch_size"] == 32  # the 8k regime is left as it was
    by = {r.name: r for r in quality.build_rows(r32, smoke=False)}
    assert {f"outer1-nesterov0.5-int4-H{h}" for h in (50, 125, 250)} <= set(by)
    assert "sparseloco-topk2bit-ef0.95-H50" in by
    assert len(by["ddp"].variants) >= 3


def test_sweep_seeds_runs_the_variants_on_the_first_seeds_and_only_the_best_on_the_rest(quality, byte_dataset,
                                                                                          tmp_path):
    out = tmp_path / "res"
    rc = quality.main(["--smoke", "--data", str(byte_dataset.root), "--results-dir", str(out), "--old-table", "",
                       "--warm-dir", str(tmp_path), "--seeds", "2", "--sweep", "1,2", "--sweep-seeds", "1",
                       "--no-curve", "--rows", "ddp"])
    assert rc == 0
    [ddp] = json.loads((out / "quality.json").read_text())["rows"]
    assert ddp["seeds"] == [0, 1] and len(ddp["val_losses"]) == 2
    assert sorted(len(v["seeds"]) for v in ddp["variants"]) == [1, 2]
    best = next(v for v in ddp["variants"] if len(v["seeds"]) == 2)
    assert best["val_loss_mean"] == ddp["val_loss_mean"]


def test_sparseloco_rows_average_over_senders_and_undo_the_dilution_over_members(quality):
    """The rows that test why SparseLoCo trails: averaged over the members that sent a coordinate,
    and averaged over all members with the outer lr raised to K."""
    r32 = quality.REGIMES["32k"]
    by = {r.name: r for r in quality.build_rows(r32, smoke=False)}
    senders = quality.row_config(r32, by["sparseloco-senders-topk2bit-ef0.95-H50"], {}, "d", 1000, 0).sync
    assert (senders.codec, senders.sparse_average, senders.ef_decay, senders.outer_lr) == ("topk2bit", "senders",
                                                                                         0.95, 1.0)
    row = by["sparseloco-members-outer-lrK-H50"]
    lrk = quality.row_config(r32, row, row.variants[0], "d", 1000, 0).sync
    assert (lrk.sparse_average, lrk.outer_lr) == ("members", float(r32["workers"]))
    row = by["sparseloco-senders-knobs-H50"]
    knobs = [quality.row_config(r32, row, v, "d", 1000, 0).sync for v in row.variants]
    assert {(s.outer_momentum, s.topk_fraction) for s in knobs} == {(0.5, 64 / 4096), (0.0, 96 / 4096)}
    assert all(s.sparse_average == "senders" for s in knobs)


def test_train_shards_limits_the_rows_corpus_and_says_so(quality, byte_dataset, tmp_path):
    out = tmp_path / "res"
    args = ["--smoke", "--data", str(byte_dataset.root), "--results-dir", str(out), "--old-table", "",
            "--warm-dir", str(tmp_path), "--seeds", "1", "--sweep", "1", "--no-curve", "--rows", "ddp"]
    assert quality.main([*args, "--train-shards", "1"]) == 0
    regime = json.loads((out / "quality.json").read_text())["regime"]
    first = byte_dataset.shard_size(0)
    assert regime["corpus"] == f"{byte_dataset.root}: {first:,} train tokens (its first 1 shards)"
    assert quality.main([*args, "--train-shards", str(byte_dataset.num_shards + 1)]) == 2


def test_combine_joins_a_row_run_on_other_seeds_by_a_later_call(quality, tmp_path):
    """--first-seed 1 in a second call: the same setting on a new seed is one row over both seeds,
    while a different setting of the row is still kept only if better."""
    def row(loss, seed, lr=4e-3):
        return {**_row("avg", loss, 350.0), "inner_lr": lr, "seeds": [seed], "val_losses": [loss],
                "val_loss_spread": 0.0, "seconds": 10.0, "variants": [{"seeds": [seed]}]}

    parts = {"a": [_row("ddp", 3.0, 1.0), row(3.2, 0)], "b": [row(3.4, 1)], "c": [row(3.1, 2, lr=2e-3)]}
    for seed, (name, rows) in enumerate(parts.items()):
        (tmp_path / f"{name}.json").write_text(json.dumps({"command": name, "rows": rows, "curves": {},
                                                           "regime": {"seeds": [seed]}}))
    joined = quality.combine([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out")
    avg = next(r for r in joined["rows"] if r["name"] == "avg")
    assert avg["seeds"] == [0, 1] and avg["val_losses"] == [3.2, 3.4] and avg["seconds"] == 20.0
    assert avg["val_loss_mean"] == pytest.approx(3.3) and avg["val_loss_spread"] == pytest.approx(0.1)
    assert avg["loss_gap_pct"] == pytest.approx(10.0) and len(avg["variants"]) == 2
    assert joined["regime"]["seeds"] == [0, 1]
    other = quality.combine([tmp_path / "a.json", tmp_path / "c.json"], tmp_path / "out2")
    avg = next(r for r in other["rows"] if r["name"] == "avg")
    assert avg["seeds"] == [2] and avg["inner_lr"] == 2e-3


def test_warm_lr_trains_the_warm_start_at_the_rows_lr(quality, byte_dataset, tmp_path):
    """--warm-lr: the warm start trains at that multiple of optim.lr (says so in its JSON), so a row
    swept to the same multiple continues at the lr its weights were trained at."""
    warm = {}
    for mult in (1.0, 4.0):
        out = tmp_path / f"res{mult:g}"
        assert quality.main(["--smoke", "--data", str(byte_dataset.root), "--results-dir", str(out), "--old-table", "",
                             "--warm-dir", str(tmp_path / f"w{mult:g}"), "--seeds", "1", "--sweep", "1", "--no-curve",
                             "--rows", "ddp", "--warm-lr", str(mult)]) == 0
        warm[mult] = json.loads((out / "quality.json").read_text())
    base = quality.SMOKE["base"]["optim"]["lr"]
    assert warm[1.0]["warm_start"]["lr"] == pytest.approx(base)
    assert warm[4.0]["warm_start"]["lr"] == pytest.approx(4 * base)
    assert warm[1.0]["init"]["sha256"] != warm[4.0]["init"]["sha256"]
    assert "--warm-lr 4.0" in warm[4.0]["command"]


def test_muloco_rows_run_muon_with_error_feedback_and_gaps_are_to_the_better_dp_row(quality):
    by = {r.name: r for r in quality.build_rows(quality.FULL_32K, smoke=False)}
    for name in ("muon-ddp", "muloco-int4-ef-H50", "muloco-2bit-ef-H125"):
        cfg = quality.row_config(quality.FULL_32K, by[name], by[name].variants[0], "d", 1000, 0)
        assert cfg.optim.inner == "muon" and cfg.optim.lr == 2 * quality.FULL_32K["base"]["optim"]["lr"]
        if name != "muon-ddp":
            assert (cfg.sync.codec, cfg.sync.error_feedback) == (name.split("-")[1], "on")
    assert sorted(v["optim.muon_lr"] for v in by["muon-ddp"].variants) == sorted(quality.FULL_32K["lr_sweep"])
    rows = [_row("ddp", 3.0, 1.0), {**_row("muon-ddp", 2.9, 1.0), "algo": "ddp"},
            _row("muloco-2bit-ef-H50", 2.958, 768.0)]
    quality.add_gaps(rows)
    assert [r["loss_gap_pct"] for r in rows] == [3.45, 0.0, 2.0]
