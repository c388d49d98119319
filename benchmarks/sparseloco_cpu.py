"""Why SparseLoCo trails DiLoCo here: its mechanisms measured on a tiny CPU model over many rounds.

In the 32k regime on a GPU (benchmarks/results/quality.json, section regime_32k_2026_12_05)
SparseLoCo was 9-16% behind DDP where DiLoCo-int4 at the same H was 3.4%, in runs of 20-67 outer
rounds. Two explanations were left: (1) members' top-k sets mostly differ, so averaging over all K
members moves a coordinate that one member sent by 1/K of it, while SparseLoCo's reference code
averages each coordinate over the members that sent it (``sync.sparse_average = "senders"``);
(2) the runs were too short for what waits in the error-feedback buffer to be sent.

This measures them on the CPU, where many rounds are affordable: a byte-level 2-layer model (dim
128, 0.5M parameters) on the bundled Shakespeare, K = 4 workers, H = 15, a constant lr after one
warm start (so a curve point after R rounds is what a run of R rounds reaches), DDP at the better of
two lrs, one seed. Two sections: 1k tokens per worker-step for 150 rounds, and 8k tokens per
worker-step for 20 rounds (the GPU runs' count at H50), since the per-worker batch decides how much
of a pseudo-gradient is signal. Also the 2-bit value coding's error, ours against the paper's, on
real error-feedback buffers. It is not the GPU regime: it shows which mechanisms matter, not the
gap a volunteer run would see.

    python3 benchmarks/sparseloco_cpu.py            # ~50 min on 2 cores (--jobs 2: two rows at once)

JSON (benchmarks/results/sparseloco_cpu.json): device, date, command, commit, regime, warm_start,
quantizer (relative error per round of both codings), and per section: rows (as quality.py's),
curves, and ``gap_by_rounds``: each row's gap to DDP after 10, 20, ... outer rounds, read off the
curves at equal tokens.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the quality benchmark's rows, warm start and row runner)

from murmur.node.model.data import Dataset  # noqa: E402
from murmur.node.sim.replicas import read_warm_start  # noqa: E402
from murmur.optim.codecs import TOPK_CHUNK, make_codec, topk_chunked  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
H = 15
REGIME = {
    "workers": 4,
    "base": {
        "name": "sparseloco-cpu", "seed": 0,
        "model": {"preset": "tiny", "dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "hidden_dim": 384,
                  "seq_len": 128},
        "data": {"tokenizer": "byte"},
        # min_lr_ratio 1: a constant lr after warm-up, so a curve point after R rounds is what a run of
        # R rounds would reach (a decaying schedule would tie every point to the run's length).
        "optim": {"lr": 2e-3, "warmup_steps": 20, "weight_decay": 0.1, "min_lr_ratio": 1.0},
        "train": {"batch_size": 8, "eval_every": 10 * H, "eval_batches": 16, "dtype": "fp32"},  # per section below
        "sync": {"overlap_steps": 0},
    },
}
EVAL_SEQUENCES = 512  # every section's validation set: 512 x 128 tokens, whatever its batch
SPARSELOCO = quality.SPARSELOCO
ROWS = [
    quality.Row("ddp", {"algorithm": "ddp", "inner_steps": H}, variants=quality.lr_variants((1.0, 2.0))),
    quality.Row(f"outer1-nesterov0.5-int4-H{H}", {"algorithm": "diloco", "inner_steps": H, "codec": "int4",
                                                  **quality.OUTER1_N05}),
    quality.Row(f"sparseloco-members-H{H}", {**SPARSELOCO, "inner_steps": H}),
    quality.Row(f"sparseloco-senders-H{H}", {**SPARSELOCO, "inner_steps": H, "sparse_average": "senders"}),
    quality.Row(f"sparseloco-members-outer-lr4-H{H}", {**SPARSELOCO, "inner_steps": H, "outer_lr": 4.0}),
    quality.Row(f"sparseloco-senders-nesterov0.5-H{H}", {**SPARSELOCO, "inner_steps": H, "sparse_average": "senders",
                                                         **quality.OUTER1_N05}),
]


def run_one(regime: dict, row: quality.Row, data: str, steps: int, init_path: str) -> tuple[dict, list]:
    torch.set_num_threads(1)  # one core a row: --jobs rows at once
    dataset = Dataset.open(data)
    out, curve, _ = quality.run_row(regime, row, data, steps, [0], torch.device("cpu"), dataset,
                                    read_warm_start(init_path), lambda s: None)
    return out, curve


def reference_2bit(vals: torch.Tensor) -> torch.Tensor:
    """The SparseLoCo paper's 2-bit value quantizer, as the paper describes it (written here from
    that description; docs/algorithms.md compares it with ours): one tensor's selected values centred
    on their mean, 4 bins of 1.5 sigma (6 sigma over 4 bins), each bin sent as the mean of the values
    that fell in it."""
    shift = vals.mean()
    c = vals - shift
    sigma = c.norm() / max(1, c.numel() - 1) ** 0.5
    scale = 6 * sigma / 4 if sigma > 0 else torch.tensor(1.0)
    q = (c / scale + 2).round().clamp(0, 3).long()
    sums = torch.zeros(4).scatter_add_(0, q, c)
    counts = torch.zeros(4).scatter_add_(0, q, torch.ones_like(c))
    return torch.where(counts > 0, sums / counts.clamp_min(1), 0.0)[q] + shift


def quantizer_errors(data: str, init_path: Path, rounds: int = 6) -> dict:
    """The relative L2 error of the top-k values' 2-bit coding, ours (sign and two magnitudes per
    4096-chunk) against the paper's (4 bins over +-6 sigma per tensor), on real error-feedback
    buffers: one worker trains H steps a round from the warm start, ef = 0.95 ef + delta, the top-64
    of each chunk is sent, ef -= sent (ours). Tensors of at least one chunk."""
    torch.manual_seed(0)
    cfg = quality.config_from_dict({**REGIME["base"], "data": {**REGIME["base"]["data"], "path": data},
                                    "train": {**REGIME["base"]["train"], "steps": rounds * H}})
    trainer = quality.Trainer(cfg, Dataset.open(data), torch.device("cpu"))
    init = read_warm_start(init_path)
    trainer.model.load_state_dict(init.weights)
    trainer.opt.load_state_dict(init.optimizer)
    codec = make_codec("topk2bit", topk_fraction=SPARSELOCO["topk_fraction"], ef_decay=SPARSELOCO["ef_decay"])
    ef: dict[str, torch.Tensor] = {}
    err = {"ours": [], "paper": []}
    for _ in range(rounds):
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        for _ in range(H):
            trainer.step()
        num = {"ours": 0.0, "paper": 0.0}
        den = 0.0
        for n, p in trainer.model.named_parameters():
            if p.numel() < TOPK_CHUNK:
                continue
            e = ef.get(n, torch.zeros_like(p)).mul(SPARSELOCO["ef_decay"]) + (before[n] - p.detach())
            idx, vals = topk_chunked(e.reshape(-1), TOPK_CHUNK, codec.k)
            sent = codec.decode(codec.encode_stateless(e.reshape(-1))).reshape(-1)
            ours = sent.reshape(-1, TOPK_CHUNK).gather(1, idx)
            num["ours"] += float((ours - vals).square().sum())
            num["paper"] += float((reference_2bit(vals.reshape(-1)).view_as(vals) - vals).square().sum())
            den += float(vals.square().sum())
            ef[n] = e - sent.view_as(e)
        for k in err:
            err[k].append(round((num[k] / den) ** 0.5, 4))
    return {"rounds": rounds, "relative_l2_error_per_round": err,
            "what": "||q(v) - v|| / ||v|| over the top-64-of-4096 values of every tensor of >= 4096 values"}


def gap_by_rounds(rows: list[dict], curves: dict[str, list]) -> dict:
    """Each row's gap to DDP (%) at every curve point, keyed by the outer rounds done by then."""
    ddp = {p[0]: p[3] for p in curves.get("ddp", [])}
    out: dict[str, dict] = {}
    for r in rows:
        if r["name"] == "ddp":
            continue
        for step, _tokens, _bytes, val in curves[r["name"]]:
            if step in ddp and step > 0 and step % H == 0:
                out.setdefault(str(step // H), {})[r["name"]] = round(100 * (val - ddp[step]) / ddp[step], 2)
    return out


def section_regime(batch: int, eval_batches: int) -> dict:
    base = {**REGIME["base"], "train": {**REGIME["base"]["train"], "batch_size": batch, "eval_batches": eval_batches}}
    return {**REGIME, "base": base}


def parse_sections(text: str) -> list[tuple[int, int]]:
    """``8x2250,64x300``: (rows per worker-step, inner steps) per section."""
    out = []
    for part in text.split(","):
        batch, _, steps = part.partition("x")
        if not (batch.isdigit() and steps.isdigit() and int(batch) > 0 and int(steps) > 0):
            raise ValueError(f"a section is ROWSxSTEPS (e.g. 64x300), got {part!r}")
        out.append((int(batch), int(steps)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/shakespeare-byte")
    p.add_argument("--sections", default="8x2250,64x300",
                   help="per-worker batch (rows of 128 tokens) x inner steps, one section each (default: 1k tokens "
                        "for 150 rounds, 8k tokens for 20 rounds)")
    p.add_argument("--warm-start-steps", type=int, default=300)
    p.add_argument("--rows", help="comma-separated subset of the rows (default all)")
    p.add_argument("--jobs", type=int, default=2, help="rows run at once, one core each")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--warm-dir", default="/tmp/murmur-sparseloco-cpu", help="where the warm start is saved")
    args = p.parse_args(argv)
    try:
        sections = parse_sections(args.sections)
    except ValueError as err:
        print(f"error: --sections: {err}", file=sys.stderr)
        return 2
    rows = ROWS
    if args.rows:
        names = args.rows.split(",")
        unknown = [n for n in names if n not in {r.name for r in ROWS}]
        if unknown:
            print(f"error: unknown rows {unknown}; known: {', '.join(r.name for r in ROWS)}", file=sys.stderr)
            return 2
        rows = [r for r in ROWS if r.name in names]
    torch.set_num_threads(args.jobs)
    init_path = Path(args.warm_dir) / "warm.pt"
    warm = quality.warm_start(REGIME, args.data, args.warm_start_steps, torch.device("cpu"), init_path)
    print(f"warm start: {json.dumps(warm)}", flush=True)
    quant = quantizer_errors(args.data, init_path)
    print(f"2-bit value coding: {json.dumps(quant)}", flush=True)
    dataset = Dataset.open(args.data)
    seq = REGIME["base"]["model"]["seq_len"]
    payload = {
        "device": quality.device_name(torch.device("cpu")) + f", {args.jobs} rows at once",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 benchmarks/sparseloco_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": quality.commit(),
        "regime": {"workers": REGIME["workers"], "H": H, "model": REGIME["base"]["model"],
                   "optim": REGIME["base"]["optim"], "seeds": [0],
                   "corpus": f"{args.data}: {sum(dataset.shard_size(i) for i in range(dataset.num_shards)):,} "
                             "train tokens",
                   "validation": f"{EVAL_SEQUENCES} sequences of {seq} tokens"},
        "warm_start": warm, "quantizer": quant, "sections": [],
        "curve_columns": ["step", "tokens", "bytes_sent_per_worker", "val_loss"],
    }
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = torch.multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        for batch, steps in sections:
            regime = section_regime(batch, max(1, EVAL_SEQUENCES // batch))
            section = {"per_worker_batch_tokens": batch * seq, "steps_after_warm_start": steps, "rounds": steps // H,
                       "rows": [], "curves": {}, "gap_by_rounds": {}}
            payload["sections"].append(section)
            pending = [pool.submit(run_one, regime, r, args.data, steps, str(init_path)) for r in rows]
            for done in futures.as_completed(pending):
                out, curve = done.result()
                section["rows"].append(out)
                section["curves"][out["name"]] = curve
                quality.add_gaps(section["rows"])
                section["gap_by_rounds"] = gap_by_rounds(section["rows"], section["curves"])
                payload["seconds"] = round(time.perf_counter() - t0, 1)
                tmp = out_dir / "sparseloco_cpu.json.tmp"
                tmp.write_text(json.dumps(payload, indent=1) + "\n")
                tmp.replace(out_dir / "sparseloco_cpu.json")
                print(json.dumps({k: v for k, v in out.items() if k != "variants"}), flush=True)
    for section in payload["sections"]:
        print(section["per_worker_batch_tokens"], json.dumps({r["name"]: r["loss_gap_pct"] for r in section["rows"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
