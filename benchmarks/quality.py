"""Quality benchmark: how close low-communication training gets to lr-tuned DDP at equal tokens.

The regime (issue 18): K = 4 workers of a ~30M-parameter Llama-style model (GPT-2 BPE, seq 256),
8k tokens per worker-step (32 x 256) as the headline, a warm start (one model trained at DDP's
global batch, as the DiLoCo paper does) and then >= 1000 inner steps per row, H in {25, 50, 100,
250}. DDP's lr and every low-communication row's inner lr are swept up and down and each row is
reported at its best variant, each variant over two seeds (mean and spread). Outer steps: plain
averaging (outer lr 1, no momentum), DiLoCo's Nesterov (lr 0.7, momentum 0.9), lr 1 with
Nesterov momentum 0.5, and an outer-lr sweep under Nesterov 0.9 (the DiLoCo scaling-law follow-up
tunes the outer lr rather than fixing it). A K=1 row (one worker alone for the same steps, so
1/K of the tokens; nothing sent), int4 beside fp32, the inner-lr rule sqrt_k, Streaming DiLoCo
with contiguous and strided fragments, SparseLoCo-style top-k with 2-bit values, DeMo with fp32
and bf16 values. Rows are named for what
they run. Then the curve: the gap of the best low-communication row (>= 250x less than DDP) against
the per-worker batch (2k, 8k, 32k, 64k tokens) at equal tokens and equal rounds (H scaled with
the batch), DDP at its best lr. The previous table (8 workers, 2k tokens per worker-step) is kept
in the JSON under ``old_table``.

    # the corpus, here (apt + network): data/quality-gpt2; carry it to the GPU machine
    bash benchmarks/quality_corpus.sh
    # the GPU run (one H200; not yet run: the rows x variants x seeds are ~200 runs of 1000 steps,
    # affordable once the stacked engine is fast). Rows can be split over calls with --rows and
    # merged with --combine; the JSON is rewritten after every run, so a cut run keeps its data.
    source benchmarks/gpu_env.sh && python3 benchmarks/quality.py --data data/quality-gpt2 \
        --steps 1000 --warm-start-steps 1000 --seeds 2 --partial-dir $OUT
    # the CPU smoke run (seconds; what tests/test_quality_bench.py runs)
    python3 benchmarks/quality.py --smoke --results-dir /tmp/quality-smoke

JSON rows: {name, algo, codec, H, workers, per_worker_batch_tokens, tokens, inner_lr, outer,
seeds, val_loss_mean, val_loss_spread, loss_gap_pct, bytes_per_worker, reduction_vs_ddp}, plus
``variants`` (every variant's mean); ``init`` names the warm start file (path, sha256) the rows
started from; ``gap_vs_batch`` is the curve; quality.png plots loss against
bytes and the gap against the batch.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from murmur.node.model.data import Dataset, eval_batches
from murmur.node.sim.replicas import read_warm_start
from murmur.node.sim.report import loss_summary, seed_summary
from murmur.node.sim.run import run_sim
from murmur.node.train.build import resolve_device
from murmur.node.train.step import evaluate
from murmur.node.train.trainer import Trainer
from murmur.optim.inner import inner_lr_for
from murmur.protocol.runconfig import config_from_dict

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent

FULL = {
    "workers": 4,
    "hs": (25, 50, 100, 250),
    "batch_tokens": (2048, 8192, 32768, 65536),  # the curve's per-worker batches
    "lr_sweep": (0.5, 1.0, 2.0, 4.0),  # DDP's lr and the main rows' inner lr, as multiples of optim.lr
    "short_sweep": (1.0, 2.0),  # the other rows' inner lr
    "demo_sweep": (0.25, 0.5),  # DeMo's sign step moves every weight by lr: a smaller lr
    "outer_sweep": (0.4, 0.7, 1.0),
    "curve_min_reduction": 250,  # the curve's row: the best one at least this far below DDP's bytes
    "base": {
        "name": "quality", "seed": 0,
        "model": {"preset": "medium", "dim": 384, "n_layers": 6, "n_heads": 6, "n_kv_heads": 6,
                  "hidden_dim": 1024, "seq_len": 256},
        "data": {"tokenizer": "gpt2"},
        "optim": {"lr": 1e-3, "warmup_steps": 50, "weight_decay": 0.1, "min_lr_ratio": 0.1},
        "train": {"batch_size": 32, "eval_every": 100, "eval_batches": 16},
        "sync": {"overlap_steps": 0},
    },
}
# Issue 39's regime: 32k tokens per worker-step (128 x 256), where volunteers' GPUs train, with H
# kept (so the traffic stays low) rather than scaled down with the batch. The warm start is the 8k
# regime's, unchanged (1000 steps of 128 x 256 at one lr): the rows start from the same weights.
# DDP's lr swept at its global batch (4 x 32k); the low-communication rows at inner lr x2 (8k's best
# at H50) unless --sweep names more.
FULL_32K = {
    **FULL,
    "hs": (50, 125, 250),
    "lr_sweep": (2.0, 4.0, 8.0),
    "short_sweep": (2.0,),
    "warm_batch": FULL["workers"] * FULL["base"]["train"]["batch_size"],
    "base": {**FULL["base"], "name": "quality-32k", "train": {**FULL["base"]["train"], "batch_size": 128}},
}
REGIMES = {"8k": FULL, "32k": FULL_32K}
# Seconds on a loaded 2-core CPU: the tiny model, 2 workers, 2 H values, short sweeps.
SMOKE = {
    "workers": 2,
    "hs": (2, 4),
    "batch_tokens": (64, 128),
    "lr_sweep": (1.0, 2.0),
    "short_sweep": (1.0,),
    "demo_sweep": (0.5,),
    "outer_sweep": (1.0,),
    "curve_min_reduction": 1,
    "base": {
        "name": "quality-smoke", "seed": 0,
        "model": {"preset": "tiny", "n_layers": 2, "seq_len": 32},
        "data": {"tokenizer": "byte"},
        "optim": {"lr": 2e-3, "warmup_steps": 1, "weight_decay": 0.1, "min_lr_ratio": 0.1},
        "train": {"batch_size": 2, "eval_every": 4, "eval_batches": 1, "dtype": "fp32"},
        "sync": {"overlap_steps": 0},
    },
}

AVG = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
NESTEROV = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
OUTER1_N05 = {"outer_lr": 1.0, "outer_momentum": 0.5, "nesterov": True}
# SparseLoCo (its paper's setting; docs/algorithms.md, the topk2bit codec): top-64 of each 4096-chunk,
# 2-bit values, EF decay 0.95, outer lr 1.
SPARSELOCO = {"algorithm": "diloco", "codec": "topk2bit", "topk_fraction": 64 / 4096, "ef_decay": 0.95, **AVG}


@dataclass(slots=True)
class Row:
    """A row: its sync and optim settings, and the variants swept (each a dict of dotted-key
    overrides; optim.lr as a multiple of the base lr). Reported at its best variant."""

    name: str
    sync: dict
    optim: dict = field(default_factory=dict)
    variants: list[dict] = field(default_factory=lambda: [{}])
    workers: int | None = None  # None: the regime's K


def lr_variants(mults) -> list[dict]:
    return [{"optim.lr": m} for m in mults]


def build_rows(regime: dict, smoke: bool) -> list[Row]:
    sweep, short, hs = lr_variants(regime["lr_sweep"]), lr_variants(regime["short_sweep"]), regime["hs"]
    rows = [Row("ddp", {"algorithm": "ddp", "inner_steps": hs[0]}, variants=sweep),
            Row("single-worker", {"algorithm": "ddp", "inner_steps": hs[0]}, variants=sweep, workers=1)]
    # MuLoCo (issue 48): Muon DDP, the other data-parallel baseline, and Muon inside DiLoCo with an
    # error-feedback int4 or 2-bit delta. Muon's lr (optim.muon_lr, from optim.lr) is swept; the AdamW
    # part's (embedding, head, norms) stays at the first multiple of the short sweep. On the CPU proxy
    # Muon DDP's best lr was far above AdamW's (benchmarks/muloco_cpu.py), so sweep it on its own.
    muon = {"inner": "muon", "muon_lr": regime["base"]["optim"]["lr"]}
    adamw_at = regime["short_sweep"][0]
    rows.append(Row("muon-ddp", {"algorithm": "ddp", "inner_steps": hs[0]}, optim=muon,
                    variants=[{"optim.lr": adamw_at, "optim.muon_lr": m}
                              for m in regime.get("muon_sweep", regime["lr_sweep"])]))
    for h in hs:
        for codec in ("int4", "2bit"):
            rows.append(Row(f"muloco-{codec}-ef-H{h}",
                            {"algorithm": "diloco", "inner_steps": h, "codec": codec, "error_feedback": "on",
                             **OUTER1_N05}, optim=muon,
                            variants=[{"optim.lr": adamw_at, "optim.muon_lr": m}
                                      for m in regime.get("muon_sweep", regime["short_sweep"])]))
    for h in hs:
        for codec in ("fp32", "int4"):
            rows.append(Row(f"avg-{codec}-H{h}", {"algorithm": "diloco", "inner_steps": h, "codec": codec, **AVG},
                            variants=sweep if codec == "fp32" else short))
        rows.append(Row(f"avg-fp32-H{h}-innerlr-sqrtk",
                        {"algorithm": "diloco", "inner_steps": h, "codec": "fp32", "inner_lr_scale": "sqrt_k", **AVG}))
        for codec in ("fp32", "int4"):
            rows.append(Row(f"nesterov0.7m0.9-{codec}-H{h}",
                            {"algorithm": "diloco", "inner_steps": h, "codec": codec, **NESTEROV}, variants=short))
            rows.append(Row(f"outer1-nesterov0.5-{codec}-H{h}",
                            {"algorithm": "diloco", "inner_steps": h, "codec": codec, **OUTER1_N05}, variants=short))
        # 1 bit a value and one fp32 scale a 256-block (1.125 bits), with error feedback: ~4x fewer
        # bytes than int4 (4.5 bits with its scales) at the same H.
        rows.append(Row(f"outer1-nesterov0.5-sign256-H{h}",
                        {"algorithm": "diloco", "inner_steps": h, "codec": "sign", "codec_block": 256, **OUTER1_N05},
                        variants=short))
        rows.append(Row(f"sparseloco-topk2bit-ef0.95-H{h}", {**SPARSELOCO, "inner_steps": h}, variants=short))
        # The same, each coordinate averaged over the members that sent it (SparseLoCo's reference
        # code; sync.sparse_average): disjoint top-k sets no longer shrink the step by 1/K.
        rows.append(Row(f"sparseloco-senders-topk2bit-ef0.95-H{h}",
                        {**SPARSELOCO, "inner_steps": h, "sparse_average": "senders"}, variants=short))
        if smoke:
            break  # one H is enough to exercise every kind of row
    # The outer lr swept (each outer lr at each of the short sweep's inner lrs) under Nesterov 0.9:
    # fp32 at H100, int4 at H50 (the H of the 250x target's row); and under Nesterov 0.5 at the
    # largest H, where a run has so few outer rounds (4 at 32k) that momentum has no time to build
    # and a step longer than the mean pseudo-gradient may be what is missing.
    for codec, h, momentum in (("fp32", hs[min(2, len(hs) - 1)], 0.9), ("int4", hs[min(1, len(hs) - 1)], 0.9),
                               ("int4", hs[-1], 0.5)):
        rows.append(Row(f"outer-lr-sweep-nesterov{momentum:g}-{codec}-H{h}",
                        {"algorithm": "diloco", "inner_steps": h, "codec": codec, "outer_momentum": momentum,
                         "nesterov": True},
                        variants=[{"sync.outer_lr": x, **v} for x in regime["outer_sweep"] for v in short]))
    h = hs[min(2, len(hs) - 1)]
    for layout in ("contiguous", "strided"):
        rows.append(Row(f"streaming-int4-{layout}-H{h}",
                        {"algorithm": "streaming", "inner_steps": h, "codec": "int4", "fragments": 2 if smoke else 3,
                         "fragment_layout": layout, **NESTEROV}, variants=short))
    # SparseLoCo's paper settings (outer lr 1, no outer momentum, EF decay 0.95), then the two knobs
    # that may explain a gap to it here: a larger outer lr (a coordinate that one of K members sends
    # moves by 1/K of it: disjoint top-k sets dilute the step) and no EF decay (at ~1.5% density a
    # coordinate waits many rounds to be sent, and 0.95 a round forgets most of what waits).
    rows.append(Row(f"sparseloco-knobs-H{hs[0]}", {**SPARSELOCO, "inner_steps": hs[0]},
                    variants=[{**knob, **v} for knob in ({}, {"sync.outer_lr": 2.0}, {"sync.ef_decay": 1.0})
                              for v in short]))
    # Averaged over senders: the outer step's Nesterov 0.5 (DiLoCo-int4's best) and 1.5x the density
    # (96 of 4096); against them, over members with outer lr K (a coordinate one member sends
    # moves by all of it, one that all send by K times their mean).
    rows.append(Row(f"sparseloco-senders-knobs-H{hs[0]}",
                    {**SPARSELOCO, "inner_steps": hs[0], "sparse_average": "senders"},
                    variants=[{**knob, **v} for knob in ({"sync.outer_momentum": 0.5, "sync.nesterov": True},
                                                         {"sync.topk_fraction": 96 / 4096})
                              for v in short]))
    rows.append(Row(f"sparseloco-members-outer-lrK-H{hs[0]}", {**SPARSELOCO, "inner_steps": hs[0]},
                    variants=[{"sync.outer_lr": float(regime["workers"]), **v} for v in short]))
    for values in ("fp32", "bf16"):
        rows.append(Row(f"demo-{values}", {"algorithm": "demo", "inner_steps": hs[0], "demo_values": values},
                        variants=lr_variants(regime["demo_sweep"])))
    return rows


def row_at_other_h(name: str, rows: list[Row]) -> Row | None:
    """``<family>-H<h>`` for an H the regime does not list (e.g. H15 in the 32k regime): the
    family's row at another H, with ``inner_steps`` set to h."""
    m = re.fullmatch(r"(.+)-H(\d+)", name)
    if not m or int(m.group(2)) < 1:
        return None
    family = next((r for r in rows if re.fullmatch(re.escape(m.group(1)) + r"-H\d+", r.name)), None)
    if family is None:
        return None
    return Row(name, {**family.sync, "inner_steps": int(m.group(2))}, family.optim, family.variants, family.workers)


def row_config(regime: dict, row: Row, variant: dict, data: str, steps: int, seed: int, batch: int | None = None):
    d = copy.deepcopy(regime["base"])
    d["seed"] = seed
    d["data"]["path"] = data
    d["train"]["steps"] = steps
    if batch:
        d["train"]["batch_size"] = batch
    d["sync"].update(row.sync)
    d["optim"].update(row.optim)
    for key, value in variant.items():
        section, name = key.split(".")
        # lrs are swept as multiples of the row's own (Muon's too: optim.muon_lr)
        d[section][name] = d[section][name] * value if key in ("optim.lr", "optim.muon_lr") else value
    return config_from_dict(d)


def describe_outer(sync) -> str:
    if sync.algorithm in ("ddp", "demo"):
        return "none"
    if sync.outer_momentum == 0 and sync.outer_lr == 1:
        return "averaging"
    kind = "nesterov" if sync.nesterov else "momentum"
    return f"lr {sync.outer_lr:g}, {kind} {sync.outer_momentum:g}"


def run_row(regime, row, data, steps, seeds, device, dataset, init, log, batch=None, sweep_seeds=None):
    """Every variant over the first ``sweep_seeds`` seeds (default: all); the best of them also over
    the remaining seeds. The row is reported at its best variant's mean over all seeds, with each
    variant's mean over the seeds it ran (``seeds`` in each entry of ``variants``)."""
    k = row.workers or regime["workers"]
    n_sweep = len(seeds) if sweep_seeds is None or len(row.variants) == 1 else max(1, min(sweep_seeds, len(seeds)))
    def run(variant, some):
        return [run_sim(row_config(regime, row, variant, data, steps, s, batch), k, device, dataset, init=init,
                        log=log) for s in some]

    best = None
    tried = []
    for variant in row.variants:
        results = run(variant, seeds[:n_sweep])
        summary = seed_summary(results, seeds[:n_sweep])
        cfg = row_config(regime, row, variant, data, steps, seeds[0], batch)
        tried.append({"variant": variant, "inner_lr": inner_lr_for(cfg.optim.lr, cfg.sync, k),
                      "seeds": seeds[:n_sweep], "val_loss_mean": round(summary["val_loss_mean"], 4)})
        if best is None or summary["val_loss_mean"] < best[1]["val_loss_mean"]:
            best = (cfg, summary, results, variant, len(tried) - 1)
    cfg, summary, results, variant, at = best
    if n_sweep < len(seeds):
        results = results + run(variant, seeds[n_sweep:])
        summary = seed_summary(results, seeds)
        tried[at] = {**tried[at], "seeds": list(seeds), "val_loss_mean": round(summary["val_loss_mean"], 4)}
    r = results[0]
    seq = cfg.model.seq_len or regime["base"]["model"]["seq_len"]
    out = {
        "name": row.name, "algo": cfg.sync.algorithm, "algorithm": cfg.sync.algorithm, "inner": cfg.optim.inner,
        "codec": r.codec, "error_feedback": cfg.sync.error_feedback, "H": cfg.sync.inner_steps, "workers": k,
        "per_worker_batch_tokens": cfg.train.batch_size * seq, "tokens": r.tokens,
        "inner_lr": inner_lr_for(cfg.optim.lr, cfg.sync, k),
        "outer": describe_outer(cfg.sync), "seeds": list(seeds), "val_losses": summary["val_losses"],
        "val_loss_mean": round(summary["val_loss_mean"], 4), "val_loss_spread": round(summary["val_loss_spread"], 4),
        "loss_gap_pct": None, "bytes_per_worker": r.bytes_per_worker,
        "reduction_vs_ddp": round(r.reduction_vs_ddp, 1) if r.bytes_per_worker else None,
        "variants": tried, "seconds": round(sum(x.seconds for x in results), 1),
    }
    curve = [[p.step, p.tokens, p.bytes_sent, round(p.val_loss, 4)] for p in r.curve]
    return out, curve, best[0]


DP_ROWS = ("ddp", "muon-ddp")  # the data-parallel baselines: gaps are taken against the better one


def add_gaps(rows: list[dict]) -> None:
    ddp = min((r for r in rows if r["name"] in DP_ROWS), key=lambda r: r["val_loss_mean"], default=None)
    for r in rows:
        if ddp:
            r["loss_gap_pct"] = round(100 * (r["val_loss_mean"] - ddp["val_loss_mean"]) / ddp["val_loss_mean"], 2)


def best_within(rows: list[dict], pct: float) -> dict | None:
    """The row that sends least among those at most ``pct`` % behind DDP."""
    return max((r for r in rows if r["loss_gap_pct"] <= pct), key=lambda r: r["reduction_vs_ddp"], default=None)


def smallest_gap_at(rows: list[dict], floor: float) -> dict | None:
    """The row closest to DDP among those sending at least ``floor`` x less."""
    return min((r for r in rows if r["reduction_vs_ddp"] >= floor), key=lambda r: r["loss_gap_pct"], default=None)


def summarize(rows: list[dict]) -> dict:
    def brief(r):
        return r and {k: r[k] for k in ("name", "reduction_vs_ddp", "loss_gap_pct")}

    low = [r for r in rows if r["loss_gap_pct"] is not None and r["reduction_vs_ddp"] and r["algo"] != "ddp"]
    out = {}
    for pct in (2, 3, 5):
        out[f"best_within_{pct}pct"] = brief(best_within(low, pct))
    for floor in (250, 1000):
        out[f"smallest_gap_at_{floor}x"] = brief(smallest_gap_at(low, floor))
    by = {r["name"]: r for r in rows}
    for r in rows:
        if r["name"].startswith("avg-int4-") and (fp := by.get(r["name"].replace("int4", "fp32"))):
            out[f"int4_vs_fp32_H{r['H']}_pct"] = round(
                100 * (r["val_loss_mean"] - fp["val_loss_mean"]) / fp["val_loss_mean"], 2)
    return out


def curve_row(rows: list[dict], names: dict[str, Row], floor: float) -> Row | None:
    """The best low-communication row: the smallest gap among those >= ``floor`` x below DDP."""
    pick = min((r for r in rows if r["name"] in names and r["algo"] != "ddp" and (r["reduction_vs_ddp"] or 0) >= floor
                and r["loss_gap_pct"] is not None), key=lambda r: r["loss_gap_pct"], default=None)
    return pick and names[pick["name"]]


def gap_vs_batch(regime, row, best_variant, ddp_variant, data, steps, seeds, device, dataset, init, log,
                 on_point=lambda points: None) -> list:
    """At equal tokens (and equal rounds: H scaled with the batch), DDP and ``row`` per batch.
    ``on_point`` gets the points so far after each one (a call cut short keeps them); the
    headline batch goes first and the smallest, the slowest to run, last."""
    base_batch, seq = regime["base"]["train"]["batch_size"], regime["base"]["model"]["seq_len"]
    total = steps * base_batch * seq
    headline = base_batch * seq
    order = sorted(regime["batch_tokens"], key=lambda t: (t != headline, t < headline, t))
    points: list[dict] = []
    for tokens in order:
        batch = max(1, tokens // seq)
        n = max(1, total // (batch * seq))
        h = max(1, round(row.sync["inner_steps"] * base_batch / batch))
        scaled = Row(row.name, {**row.sync, "inner_steps": min(h, n)}, row.optim, [best_variant])
        ddp = Row("ddp", {"algorithm": "ddp", "inner_steps": min(h, n)}, variants=[ddp_variant])
        a, _, _ = run_row(regime, ddp, data, n, seeds, device, dataset, init, log, batch)
        b, _, _ = run_row(regime, scaled, data, n, seeds, device, dataset, init, log, batch)
        points.append({"per_worker_batch_tokens": batch * seq, "steps": n, "H": scaled.sync["inner_steps"],
                       "row": row.name, "ddp_val_loss": a["val_loss_mean"], "row_val_loss": b["val_loss_mean"],
                       "loss_gap_pct": round(100 * (b["val_loss_mean"] - a["val_loss_mean"]) / a["val_loss_mean"], 2),
                       "reduction_vs_ddp": b["reduction_vs_ddp"]})
        points.sort(key=lambda p: p["per_worker_batch_tokens"])
        on_point(points)
    return points


def warm_start(regime, data, steps, device, path: Path, lr_mult: float = 1.0) -> dict:
    """One model trained ``steps`` steps at DDP's global batch (K x the rows' batch), saved with
    its AdamW state; every row continues from it. Its loss is taken on the rows' validation
    batches (the rows' batch size and count), so it is the rows' step-0 loss. Its lr is
    ``lr_mult`` x optim.lr: at 1 (every run before 2026-12-06) a row swept to x4 starts by warming
    up to 4x the lr the weights were trained at, a jump its curve shows (loss up after step 0)."""
    d = copy.deepcopy(regime["base"])
    d["data"]["path"] = data
    d["optim"]["lr"] *= lr_mult
    rows_batch = d["train"]["batch_size"]
    d["train"].update(steps=steps, batch_size=regime.get("warm_batch", regime["workers"] * rows_batch))
    d["optim"]["min_lr_ratio"] = 1.0  # stay at the peak: the rows' schedules continue one schedule
    cfg = config_from_dict(d)
    torch.manual_seed(cfg.seed)
    dataset = Dataset.open(data)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, dataset, device)
    val = eval_batches(dataset, rows_batch, trainer.model.cfg.seq_len, cfg.train.eval_batches)
    before = evaluate(trainer.model, val, device, cfg.train.dtype)
    for _ in range(steps):
        trainer.step()
    after = evaluate(trainer.model, val, device, cfg.train.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict()}, path)
    return {"steps": steps, "batch_size": cfg.train.batch_size, "lr": cfg.optim.lr,
            "tokens": steps * cfg.train.batch_size * trainer.model.cfg.seq_len,
            "val_loss_before": round(before, 4), "val_loss": round(after, 4),
            "val_set": f"the rows': {len(val)} batches of {rows_batch}", "seconds": round(time.perf_counter() - t0, 1)}


def sha256(path: Path) -> str:
    """The warm start file's hash: calls that name the same one started from the same weights."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5.5), dpi=120)
    a.set_prop_cycle(color=plt.cm.tab20.colors)
    for name, pts in payload["curves"].items():
        pts = [p for p in pts if p[2] > 0]
        if pts:
            a.plot([p[2] for p in pts], [p[3] for p in pts], marker="o", markersize=3, label=name)
    a.set_xscale("log")
    a.set(xlabel="bytes sent per worker (log scale)", ylabel="validation loss", title="loss against bytes")
    a.grid(True, which="both", alpha=0.3)
    if a.lines:
        a.legend(fontsize=5, ncol=2)
    gap = payload.get("gap_vs_batch") or []
    if gap:
        b.plot([p["per_worker_batch_tokens"] for p in gap], [p["loss_gap_pct"] for p in gap], marker="o",
               label=gap[0]["row"])
        b.legend(fontsize=7)
    else:
        b.text(0.5, 0.5, "not run", transform=b.transAxes, ha="center", va="center", fontsize=14, color="gray")
    b.set_xscale("log")
    b.set(xlabel="tokens per worker-step (log scale)", ylabel="gap to DDP (%)", title="gap against the batch")
    b.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_json(path: Path, payload: dict) -> None:
    """Atomically: a run cut short leaves the whole JSON of its last write."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def write(dirs: list[Path], payload: dict) -> None:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        write_json(d / "quality.json", payload)
        plot(payload, d / "quality.png")


def old_table(path: Path | None) -> dict | None:
    """The previous regime's table (a JSON without ``regime``), kept as a section."""
    if not path or not path.is_file():
        return None
    old = json.loads(path.read_text())
    return old.get("old_table") if "regime" in old else old


SETTING_KEYS = ("algo", "codec", "H", "workers", "per_worker_batch_tokens", "tokens", "inner_lr", "outer")


def same_setting_other_seeds(a: dict, b: dict) -> bool:
    """Two calls ran one row at the same setting on different seeds (``--first-seed``)."""
    if not (a.get("seeds") and b.get("seeds")):
        return False
    return all(a.get(k) == b.get(k) for k in SETTING_KEYS) and not set(a["seeds"]) & set(b["seeds"])


def join_seeds(a: dict, b: dict) -> dict:
    s = loss_summary(a["val_losses"] + b["val_losses"], a["seeds"] + b["seeds"])
    return {**a, **s, "val_loss_mean": round(s["val_loss_mean"], 4), "val_loss_spread": round(s["val_loss_spread"], 4),
            "seconds": round(a.get("seconds", 0) + b.get("seconds", 0), 1)}


def combine(paths: list[Path], out: Path) -> dict:
    """Calls that ran different --rows or different --sweep values, as one result: a row that
    several calls ran is the best of them, with every call's variants listed (and its curve from
    the best); gaps and the summary are recomputed. Each call's command and warm start are kept
    under ``parts``: calls that trained their own warm start did not start from the same weights.
    A row that two calls ran at the same setting on different seeds is one row over all of them."""
    parts = [json.loads(p.read_text()) for p in paths]
    merged = dict(parts[0])
    best: dict[str, dict] = {}
    curves: dict[str, list] = {}
    for part in parts:
        for r in part["rows"]:
            kept = best.get(r["name"])
            tried = (kept["variants"] if kept else []) + r.get("variants", [])
            if kept is not None and same_setting_other_seeds(kept, r):
                best[r["name"]] = {**join_seeds(kept, r), "variants": tried}
                continue
            if kept is None or r["val_loss_mean"] < kept["val_loss_mean"]:
                best[r["name"]] = dict(r)
                curves[r["name"]] = part["curves"].get(r["name"], [])
            best[r["name"]]["variants"] = tried
    merged["rows"] = list(best.values())
    merged["curves"] = curves
    merged["parts"] = [{"command": p["command"], "warm_start": p.get("warm_start"), "init": p.get("init"),
                        "rows": [r["name"] for r in p["rows"]]} for p in parts]
    merged["warm_start"] = next((p["warm_start"] for p in parts if p.get("warm_start")), None)
    merged["gap_vs_batch"] = next((p["gap_vs_batch"] for p in parts if p.get("gap_vs_batch")), [])
    merged["command"] = " ; ".join(p["command"] for p in parts)
    if "regime" in merged:  # the seeds of every call (--first-seed), not only the first call's
        merged["regime"] = {**merged["regime"],
                            "seeds": sorted({s for p in parts for s in p.get("regime", {}).get("seeds", [])})}
    add_gaps(merged["rows"])
    merged["summary"] = summarize(merged["rows"])
    write([out], merged)
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny CPU version (seconds): what the tests run")
    p.add_argument("--data", help="dataset (default: data/quality-gpt2; --smoke: data/shakespeare-byte)")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, help="inner steps per row after the warm start (default 1000; smoke 4)")
    p.add_argument("--warm-start-steps", type=int, help="warm start steps at DDP's batch (default 1000; smoke 2)")
    p.add_argument("--warm-lr", type=float, default=1.0,
                   help="the warm start's lr as a multiple of optim.lr (default 1): the rows' --sweep multiple "
                        "makes the rows continue at the lr the warm start trained at")
    p.add_argument("--regime", choices=sorted(REGIMES), default="8k",
                   help="tokens per worker-step of the rows: 8k (32 x 256; H 25-250) or 32k (128 x 256; H 50, 125, "
                        "250; DDP's lr swept x2, x4, x8); both start from the same warm start")
    p.add_argument("--workers", type=int, help="K, the number of workers (default 4): the K=8 row")
    p.add_argument("--seeds", type=int, default=2, help="seeds per variant (default 2)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed (default 0): a later call runs more seeds, joined by --combine")
    p.add_argument("--sweep-seeds", type=int, help="run a row's variants on this many seeds first and only the best "
                                                   "on the rest (default: every variant on every seed)")
    p.add_argument("--rows", help="comma-separated subset of the rows (default all)")
    p.add_argument("--sweep", help="lr multiples for DDP's and the rows' lr sweeps, comma-separated (default: the "
                                   "regime's, 0.5,1,2,4 for the main rows and 1,2 for the others): to fit a budget")
    p.add_argument("--muon-sweep", help="Muon's lr multiples (optim.muon_lr) in the Muon rows, comma-separated "
                                        "(default: the lr sweep for muon-ddp, the short sweep for the MuLoCo rows); "
                                        "their AdamW part stays at the short sweep's first multiple")
    p.add_argument("--demo-sweep", help="DeMo's lr multiples, comma-separated (default 0.25,0.5)")
    p.add_argument("--outer-sweep", help="outer lrs of the outer-lr-sweep rows, comma-separated (default 0.4,0.7,1)")
    p.add_argument("--no-curve", action="store_true", help="skip the gap-vs-batch curve")
    p.add_argument("--curve-row", help="run only the gap-vs-batch curve, for this row (no table rows): DDP and the "
                                       "row each at the first --sweep multiple")
    p.add_argument("--curve-batches", help="the curve's per-worker batches in tokens, comma-separated (default: the "
                                           "regime's, 2048,8192,32768,65536): to fit a budget")
    p.add_argument("--train-shards", type=int, help="the rows train on only the first N shards of the corpus (the "
                                                    "warm start on all): how much repetition changes the gap")
    p.add_argument("--init-from", help="a warm start made earlier (instead of training one)")
    p.add_argument("--warm-dir", default="/tmp/murmur-quality", help="where the warm start is saved")
    p.add_argument("--old-table", default=str(RESULTS / "quality.json"),
                   help="the previous table to keep as the old_table section")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--partial-dir", help="also write the JSON/PNG here after every row (e.g. $OUT)")
    p.add_argument("--commit", help="the commit measured, where the tree has no .git (the GPU machine)")
    p.add_argument("--combine", metavar="JSON[,JSON...]", help="merge calls' JSONs into --results-dir")
    args = p.parse_args(argv)
    if args.combine:
        combine([Path(x) for x in args.combine.split(",")], Path(args.results_dir))
        return 0
    regime = dict(SMOKE if args.smoke else REGIMES[args.regime])
    if args.workers:
        regime["workers"] = args.workers
    def numbers(text: str, kind=float) -> tuple:
        return tuple(kind(x) for x in text.split(","))

    if args.sweep:
        regime["lr_sweep"] = regime["short_sweep"] = numbers(args.sweep)
    if args.demo_sweep:
        regime["demo_sweep"] = numbers(args.demo_sweep)
    if args.muon_sweep:
        regime["muon_sweep"] = numbers(args.muon_sweep)
    if args.curve_batches:
        regime["batch_tokens"] = numbers(args.curve_batches, int)
    if args.outer_sweep:
        regime["outer_sweep"] = numbers(args.outer_sweep)
    data = args.data or ("data/shakespeare-byte" if args.smoke else "data/quality-gpt2")
    steps = args.steps or (4 if args.smoke else 1000)
    warm_steps = args.warm_start_steps if args.warm_start_steps is not None else (2 if args.smoke else 1000)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    rows = build_rows(regime, args.smoke)
    by_name = {r.name: r for r in rows}
    if args.curve_row:
        if args.curve_row not in by_name:
            print(f"error: unknown --curve-row {args.curve_row!r}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        rows = []
    elif args.rows:
        for n in args.rows.split(","):
            if n not in by_name and (derived := row_at_other_h(n, rows)):
                by_name[n] = derived
        unknown = [n for n in args.rows.split(",") if n not in by_name]
        if unknown:
            print(f"error: unknown rows {unknown}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        rows = [by_name[n] for n in args.rows.split(",")]
    device = resolve_device("cpu" if args.smoke and args.device == "auto" else args.device)
    dataset = Dataset.open(data)
    if args.train_shards:
        if not 0 < args.train_shards <= dataset.num_shards:
            print(f"error: --train-shards must be in [1, {dataset.num_shards}], got {args.train_shards}",
                  file=sys.stderr)
            return 2
        dataset = Dataset(dataset.root, {**dataset.manifest, "shards": dataset.manifest["shards"][:args.train_shards]})
    old = old_table(Path(args.old_table) if args.old_table else None)
    warm, init_path = None, args.init_from
    if warm_steps and not init_path:
        init_path = Path(args.warm_dir) / ("warm-smoke.pt" if args.smoke else "warm.pt")
        warm = warm_start(regime, data, warm_steps, device, init_path, args.warm_lr)
        print(f"warm start: {json.dumps(warm)}", flush=True)
    init = read_warm_start(init_path) if init_path else None
    init_file = {"path": str(init_path), "sha256": sha256(Path(init_path))} if init_path else None
    quiet = (lambda s: None) if args.smoke else (lambda s: print(s, flush=True))
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    seq_len = regime["base"]["model"]["seq_len"]
    payload = {
        "device": device_name(device), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python3 benchmarks/quality.py {argv_text}", "commit": args.commit or commit(),
        "regime": {"name": "smoke" if args.smoke else args.regime, "workers": regime["workers"],
                   "per_worker_batch_tokens": regime["base"]["train"]["batch_size"] * seq_len,
                   "steps_after_warm_start": steps, "seeds": seeds, "sweep_seeds": args.sweep_seeds,
                   "lr_sweep": regime["lr_sweep"], "short_sweep": regime["short_sweep"],
                   "model": regime["base"]["model"], "optim": regime["base"]["optim"], "train": regime["base"]["train"],
                   "corpus": f"{data}: {sum(dataset.shard_size(i) for i in range(dataset.num_shards)):,} train tokens"
                             + (f" (its first {args.train_shards} shards)" if args.train_shards else ""),
                   "smoke": args.smoke},
        "warm_start": warm, "init": init_file, "rows": [], "summary": {}, "curves": {},
        "curve_columns": ["step", "tokens", "bytes_sent_per_worker", "val_loss"], "gap_vs_batch": [],
    }
    if old is not None:
        payload["old_table"] = old
    dirs = [Path(args.results_dir)] + ([Path(args.partial_dir)] if args.partial_dir else [])
    best_variant: dict[str, dict] = {}
    for row in rows:
        print(f"== {row.name}", flush=True)
        out, curve, _ = run_row(regime, row, data, steps, seeds, device, dataset, init, quiet,
                                sweep_seeds=args.sweep_seeds)
        best_variant[row.name] = min(out["variants"], key=lambda v: v["val_loss_mean"])["variant"]
        payload["rows"].append(out)
        payload["curves"][row.name] = curve
        add_gaps(payload["rows"])
        payload["summary"] = summarize(payload["rows"])
        write(dirs, payload)
        print(json.dumps({k: v for k, v in out.items() if k != "variants"}), flush=True)
    if args.curve_row:
        pick = by_name[args.curve_row]
        best_variant[pick.name] = best_variant["ddp"] = {"optim.lr": regime["lr_sweep"][0]}
    else:
        pick = curve_row(payload["rows"], by_name, regime["curve_min_reduction"])
    if not args.no_curve and pick is not None and "ddp" in best_variant:
        print(f"== gap vs batch: {pick.name}", flush=True)
        def partial(points: list[dict]) -> None:
            payload["gap_vs_batch"] = points
            write(dirs, payload)

        gap_vs_batch(regime, pick, best_variant[pick.name], best_variant["ddp"], data, steps, seeds, device, dataset,
                     init, quiet, partial)
    print(json.dumps(payload["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
