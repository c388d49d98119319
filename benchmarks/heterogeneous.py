"""Volunteers of different speeds: fixed H against sync.round_budget = "speed" (issue 38).

    python benchmarks/heterogeneous.py                      # node and simulator rows (~20-30 minutes, CPU)
    python benchmarks/heterogeneous.py --duration 60 --sim-rounds 10 --sim-seeds 0

Node rows: each a fresh `murmur testnet up` (real processes on loopback, configs/testnet-tiny.toml
with H=30 and 16-row batches so that compute outweighs the exchange, one torch thread a node, a
coordinator with its DHT) of 4 nodes with ``--speeds 1,1,2,4`` (slowdown factors: node i sleeps
factor - 1 times each inner step's own time), once with ``round_budget = "fixed"`` and once with
``"speed"``. The global model is evaluated after every round. A row lasts ``--duration`` on the
bundled corpus read three times (14.8M tokens: with 4.9M a quiet machine's rows ended when their
data did, after 100 s fixed and 50 s speed, and the ratio of two such short rows swung by 15%).
Read back from the nodes' round records, past the first two rounds (the speeds are
not measured yet):

    tokens_per_min                tokens of completed rounds, all nodes, per minute of the span
    fast_node_busy_fraction       node-0 (speed 1): compute seconds / wall seconds from its first
                                  counted window's start to its last one's end (the gaps between
                                  windows count as idle; the run at 2db413f divided by its windows only)
    slowest_node_busy_fraction    the same for node-3 (speed 4)
    fast_node_time                node-0's wall time split: compute, blocked on the exchange,
                                  between windows; filled_steps_per_round: steps it trained while
                                  a round was in flight (sync.fill_wait, carried to its next window)
    val_loss_at_equal_wall_time   the global model's validation loss at the shorter row's span
    val_loss_at_equal_tokens      ... once both rows had trained the smaller row's tokens

Simulator rows (node/sim/hetero.py, the same budget rule, weights and DiLoCo code on a simulated
clock, on the CPU): 4 workers, testnet-tiny's byte-level model (~0.1M parameters; the quality
benchmark's 30M model is out of reach of a loaded 2-core CPU here), 8-row batches, ``--sim-rounds``
rounds of H=20, for each of ``--sim-seeds``; speeds
{1,1,2,4} fixed and by speed, and a homogeneous run {1,1,1,1} for the quality reference. Time is
in inner steps of a speed-1 worker; busy fractions are exact there. The simulated speeds do not
swing, so the shares end together to a step and ``sync.fill_wait`` (training on while a round is in
flight, which the node rows use) has nothing to fill there: the simulator does not model it. The
workers' data is one pool handed out each round by share (``--sim-data pooled``, as the nodes lease
shards from one pool), so at equal tokens every rule has trained on the same tokens; ``dealt`` gives
worker i shards i, i+4, ... of its own, which a fast worker wraps round long before the group has
seen the data, and the rows then differ in how often they repeat data, not only in the rule.

    sim_gap_vs_tokens             the speed rule's val loss against the homogeneous run's at the
                                  same tokens, in percent (positive: worse), at each evaluation,
                                  its mean, least and most over the seeds
    sim_worst_gap_pct             the most the heterogeneous run was worse, any seed, any point
    sim_val_at_equal_tokens_speed_vs_homogeneous_pct   the gap at the rows' end (seeds' mean)

Targets (issue 38): every node busy >= 90% under the rule; tokens/min >= 1.8x fixed H; val loss at
equal tokens within 1% of a homogeneous run (sim rows), read as: never worse than the homogeneous
run by more than 1% as training goes on (``sim_never_worse_than_homogeneous_by_1pct``); being
better is no failure of the rule (the fast workers' longer windows are more sequential steps per
round, which helps early in training).

    python benchmarks/heterogeneous.py --sim-only --sim-rounds 200 --sim-seeds 0 --out /tmp/s0.json
    python benchmarks/heterogeneous.py --replace-sim /tmp/s0.json /tmp/s1.json   # node rows kept
    python benchmarks/heterogeneous.py --nodes-only                                # sim rows kept
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "heterogeneous.json"
SPEEDS = [1.0, 1.0, 2.0, 4.0]
H = 30  # node rows: long enough that compute outweighs a round's exchange on loopback
SIM_H = 20
SIM_ROUNDS = 200  # the rows run past where the speed rule's early lead fades (sim_gap_vs_tokens)
SIM_SEEDS = [0, 1, 2]


def _seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers such as 0,1,2, got {text!r}") from None
NODE_SETS = [f"sync.inner_steps={H}", "train.batch_size=16", f"train.eval_every={H}", "train.eval_batches=4",
             "train.steps=1000000", "optim.warmup_steps=20"]


def _interp(points: list[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation of (x, y) points sorted by x; None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def node_row(rule: str, duration: float, out: Path, data: Path) -> dict:
    from murmur.node.daemon.state_dir import read_rounds

    cmd = [sys.executable, "-m", "murmur.cli", "testnet", "up", "--nodes", str(len(SPEEDS)),
           "--speeds", ",".join(f"{s:g}" for s in SPEEDS), "--config", "configs/testnet-tiny.toml",
           "--duration", str(duration), "--out", str(out), "--set", f'sync.round_budget="{rule}"',
           "--set", f'data.path="{data}"',
           *(a for s in NODE_SETS for a in ("--set", s))]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=duration + 600)
    if done.returncode != 0:
        raise SystemExit(f"testnet row {rule} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    recs = [[r for r in read_rounds(out / "nodes" / f"node-{i}") if "loss" in r] for i in range(len(SPEEDS))]
    start_round = 2  # rounds 1-2: H each, the speeds not measured and announced yet
    first = min(r["time"] - r["seconds"] for rs in recs for r in rs if r["round"] > start_round)
    last = max(r["time"] for rs in recs for r in rs)
    span = [[r for r in rs if r["round"] > start_round and r["contributed"]] for rs in recs]
    tokens = sum(r["tokens"] for rs in span for r in rs)

    def wall(rs: list[dict]) -> float:
        # From its first counted window's start to its last one's end: the gaps between windows
        # (the evaluation, the round's record and snapshot) and any round it sat out count as idle.
        return max(1e-9, max(r["window_ended"] for r in rs) - min(r["window_started"] for r in rs))

    def busy(rs: list[dict]) -> float:
        return sum(r["compute_seconds"] for r in rs) / wall(rs)

    def breakdown(rs: list[dict]) -> dict:
        w = wall(rs)
        windows = sum(r["seconds"] for r in rs)
        return {"compute": round(sum(r["compute_seconds"] for r in rs) / w, 3),
                "exchange_wait": round(sum(r["exchange_wait_seconds"] for r in rs) / w, 3),
                "between_windows": round((w - windows) / w, 3),
                "filled_steps_per_round": round(sum(r.get("filled", 0) for r in rs) / max(1, len(rs)), 1)}

    # The global model's curve (every node records the same state; node-0's evaluations), against
    # the seconds since the span began and the tokens all nodes trained by then, the first rounds'
    # included (under the speed rule the fast nodes train on through those rounds' long first
    # exchanges: counted from the span, that head start looked like a better loss per token).
    by_round: dict[int, int] = {}
    for rs in recs:
        for r in rs:
            if r["contributed"]:
                by_round[r["round"]] = by_round.get(r["round"], 0) + r["tokens"]
    curve = []
    for r in span[0]:
        if r.get("val_loss") is not None:
            acc = sum(t for rr, t in by_round.items() if rr <= r["round"])
            curve.append({"t": r["time"] - first, "tokens": acc, "val": r["val_loss"]})
    return {
        "rule": rule, "speeds": SPEEDS, "source": "nodes", "span_s": round(last - first, 1),
        "rounds": len({r["round"] for rs in span for r in rs}), "tokens": tokens,
        "tokens_per_min": round(tokens / (last - first) * 60, 1),
        "fast_node_busy_fraction": round(busy(span[0]), 3),
        "slowest_node_busy_fraction": round(busy(span[-1]), 3),
        "fast_node_time": breakdown(span[0]),
        "steps_per_round": [round(sum(r["steps"] for r in rs) / max(1, len(rs)), 1) for rs in span],
        "wall_s": round(time.time() - t0, 1), "curve": curve,
    }


# The quality benchmark's model (benchmarks/quality.py FULL: 384 wide, 6 blocks, seq 256, 32 rows a
# worker-step, H 50, its optimizer), on the byte-level corpus: its GPT-2 corpus is not built here.
QUALITY_SETS = [
    'model.preset="medium"', "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.n_kv_heads=6",
    "model.hidden_dim=1024", "model.seq_len=256", "optim.lr=1e-3", "optim.warmup_steps=50",
    "optim.weight_decay=0.1", "optim.min_lr_ratio=0.1", "train.batch_size=32", "train.eval_batches=16",
    "sync.inner_steps=50", "sync.outer_lr=1.0", "sync.outer_momentum=0.5",
]


def sim_rows(rounds: int, device: str = "cpu", model: str = "tiny", seed: int = 0, data: str = "pooled") -> list[dict]:
    import torch

    from murmur.node.sim.hetero import run_hetero
    from murmur.node.train.build import open_run_dataset, resolve_device
    from murmur.protocol.runconfig import load_config

    if device == "cpu":
        torch.set_num_threads(1)
    dev = resolve_device(device)
    sets = QUALITY_SETS if model == "quality" else [f"sync.inner_steps={SIM_H}", "train.batch_size=8",
                                                   "train.eval_batches=8"]
    rows = []
    for rule, speeds in (("fixed", SPEEDS), ("speed", SPEEDS), ("fixed", [1.0] * len(SPEEDS))):
        cfg = load_config(ROOT / "configs" / "testnet-tiny.toml", [
            f'data.path="{ROOT / "data" / "shakespeare-byte"}"', f'sync.round_budget="{rule}"', *sets,
            f"seed={seed}",
        ])
        t0 = time.time()
        r = run_hetero(cfg, speeds, dev, open_run_dataset(cfg), rounds=rounds, eval_every_rounds=1, data=data,
                       log=lambda _: None)
        rows.append({
            "rule": rule, "speeds": speeds, "source": f"sim/{model}/{dev.type}/{data}", "seed": seed, "rounds": rounds,
            "H": cfg.sync.inner_steps, "tokens": r.tokens,
            "sim_time_steps": r.time, "tokens_per_step_time": round(r.tokens / r.time, 1),
            "fast_node_busy_fraction": round(r.busy[0], 3), "busy": [round(b, 3) for b in r.busy],
            "final_val": round(r.curve[-1].val_loss, 4), "wall_s": round(time.time() - t0, 1),
            "curve": [{"t": p.time, "tokens": p.tokens, "val": p.val_loss} for p in r.curve],
        })
        print(f"sim {data} seed {seed} {rule} {speeds}: {r.tokens:,} tokens in {r.time:,.0f} step-times, "
              f"busy {r.busy}, val {r.curve[-1].val_loss:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return rows


def compare(rows: list[dict]) -> None:
    """val_loss_at_equal_wall_time / _tokens: each row's curve read at the smallest row's end."""
    t_eq = min(r["curve"][-1]["t"] for r in rows)
    tok_eq = min(r["curve"][-1]["tokens"] for r in rows)
    for r in rows:
        pts_t = [(p["t"], p["val"]) for p in r["curve"]]
        pts_k = [(p["tokens"], p["val"]) for p in r["curve"]]
        v_t, v_k = _interp(pts_t, t_eq), _interp(pts_k, tok_eq)
        r["val_loss_at_equal_wall_time"] = None if v_t is None else round(v_t, 4)
        r["val_loss_at_equal_tokens"] = None if v_k is None else round(v_k, 4)
        r["equal_wall_time"], r["equal_tokens"] = round(t_eq, 1), tok_eq


def _header(args: argparse.Namespace, device: str) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {
        "benchmark": "heterogeneous",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit or os.environ.get("MURMUR_COMMIT", ""),
        "command": "python " + " ".join(sys.argv),
        "device": device,
    }


def _curve_key(r: dict) -> str:
    seed = f"/seed{r['seed']}" if r["source"].startswith("sim/") else ""
    return f"{r['source']}{seed}/{r['rule']}/{','.join(f'{s:g}' for s in r['speeds'])}"


def _sim_by_seed(sims: list[dict]) -> dict[str, dict[str, dict]]:
    """"<source>/seed<n>" -> {"fixed", "speed", "homogeneous"} -> its sim row."""
    out: dict[str, dict[str, dict]] = {}
    for r in sims:
        name = "homogeneous" if len(set(r["speeds"])) == 1 else r["rule"]
        out.setdefault(f"{r['source']}/seed{r.get('seed', 0)}", {})[name] = r
    return out


def gap_curve(speed: dict, homo: dict) -> list[dict]:
    """The speed rule's val loss against the homogeneous run's at the same tokens, in percent, at
    each of the homogeneous run's evaluations (positive: the heterogeneous run is worse)."""
    pts = [(p["tokens"], p["val"]) for p in speed["curve"]]
    out = []
    for p in homo["curve"][1:]:
        v = _interp(pts, p["tokens"])
        if v is not None:
            out.append({"tokens": p["tokens"], "gap_pct": round(100 * (v / p["val"] - 1), 2)})
    return out


def _sim_ratios(sims: list[dict]) -> tuple[dict, list[dict]]:
    """The simulator's ratios, over its seeds, and the gap curve (the speed rule against the
    homogeneous run at equal tokens, as training goes on: its mean, least and most over the seeds).

    What the issue's "val loss at equal tokens within 1% of a homogeneous run" asks is that uneven
    shares cost no quality: the target is met when the heterogeneous run is never worse than the
    homogeneous one by more than 1% at equal tokens (``sim_worst_gap_pct`` <= 1). Being better is
    no failure: the speed rule's fast workers take more sequential inner steps per round (the
    token-weighted mean is sum(n_i^2)/sum(n_i), 24 steps for shares 29, 29, 15, 7 against 20), which
    helps early in training; the curve shows how much of that lead remains later."""
    seeds = _sim_by_seed(sims)
    gaps = {seed: gap_curve(rows["speed"], rows["homogeneous"]) for seed, rows in sorted(seeds.items())}
    common = sorted(set.intersection(*({g["tokens"] for g in c} for c in gaps.values())))
    curve = []
    for t in common:
        at = [next(g["gap_pct"] for g in c if g["tokens"] == t) for c in gaps.values()]
        curve.append({"tokens": t, "gap_pct_mean": round(sum(at) / len(at), 2), "gap_pct_min": min(at),
                      "gap_pct_max": max(at)})
    final = {seed: c[-1]["gap_pct"] for seed, c in gaps.items() if c}
    worst = max(g["gap_pct"] for c in gaps.values() for g in c)
    half = [p["gap_pct_mean"] for p in curve[len(curve) // 2:]]
    ratio = [rows["speed"]["tokens_per_step_time"] / rows["fixed"]["tokens_per_step_time"]
             for rows in seeds.values() if "fixed" in rows]
    ratios = {
        "sim_tokens_per_time_speed_over_fixed": round(sum(ratio) / len(ratio), 2) if ratio else None,
        "sim_seeds": sorted({r.get("seed", 0) for r in sims}),
        "sim_rounds": max(r["rounds"] for r in sims),
        # At the end of the rows (the mean over the seeds; each seed's beside it).
        "sim_val_at_equal_tokens_speed_vs_homogeneous_pct": round(sum(final.values()) / len(final), 2),
        "sim_val_at_equal_tokens_speed_vs_homogeneous_pct_per_seed": final,
        "sim_gap_pct_mean_over_second_half": round(sum(half) / len(half), 2) if half else None,
        # The most the heterogeneous run was worse than the homogeneous one, any seed, any point.
        "sim_worst_gap_pct": worst,
        "sim_never_worse_than_homogeneous_by_1pct": worst <= 1.0,
    }
    return ratios, curve


def _sim_doc(sims: list[dict]) -> dict:
    """The simulator's part of the result: its rows, ratios, gap curve and val curves."""
    compare(sims)  # the homogeneous run is the shortest in time: every row read at its end
    ratios, gap = _sim_ratios(sims)
    return {"rows": [{k: v for k, v in r.items() if k != "curve"} for r in sims], "ratios": ratios,
            "sim_gap_vs_tokens": gap, "curves": {_curve_key(r): r["curve"] for r in sims}}


def write_sim_only(args: argparse.Namespace) -> int:
    import torch

    sims = [r for seed in args.sim_seeds
            for r in sim_rows(args.sim_rounds, args.sim_device, args.sim_model, seed, args.sim_data)]
    name = torch.cuda.get_device_name() if args.sim_device.startswith("cuda") else (
        f"CPU only: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, one torch thread a row")
    doc = {**_header(args, name), **_sim_doc(sims)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["ratios"]))
    return 0


def replace_sim(args: argparse.Namespace) -> int:
    """--out's simulator rows replaced by those of --sim-only results (one or several seeds), its
    node rows, their commit and header kept as they are; the simulator's own runs are named under
    ``sim_runs``."""
    doc = json.loads(Path(args.out).read_text())
    parts = [json.loads(Path(f).read_text()) for f in args.replace_sim]
    sims = []
    for part in parts:
        for r in part["rows"]:
            sims.append({**r, "curve": part["curves"][_curve_key({"seed": 0, **r})]})
    if len({(r["source"], r.get("seed", 0), r["rule"], tuple(r["speeds"])) for r in sims}) != len(sims):
        raise SystemExit("--replace-sim: two results hold the same seed's rows")
    sim = _sim_doc(sims)
    nodes = [r for r in doc["rows"] if r["source"] == "nodes"]
    doc["rows"] = [*nodes, *sim["rows"]]
    doc["ratios"] = {k: v for k, v in doc["ratios"].items() if not k.startswith("sim_")} | sim["ratios"]
    doc["sim_gap_vs_tokens"] = sim["sim_gap_vs_tokens"]
    doc["curves"] = {k: v for k, v in doc["curves"].items() if k.startswith("nodes/")} | sim["curves"]
    doc["sim_runs"] = [{k: p[k] for k in ("date", "commit", "command", "device")} for p in parts]
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["ratios"]))
    print(f"replaced the simulator rows of {args.out} ({len(sims)} rows from {len(parts)} results)")
    return 0


def replace_nodes(args: argparse.Namespace, nodes: list[dict], load0: tuple[float, ...]) -> int:
    """--nodes-only: --out's node rows, ratio and header replaced by a new run's; its simulator rows
    stay, with their own runs named under ``sim_runs`` (the header's until now)."""
    doc = json.loads(Path(args.out).read_text())
    if "sim_runs" not in doc:  # the simulator rows came with the header's run
        doc["sim_runs"] = [{k: doc[k] for k in ("date", "commit", "command", "device")}]
    fixed_n, speed_n = nodes
    doc.update(_header(args, f"CPU only: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"))
    doc["load_average_before"] = [round(x, 2) for x in load0]
    doc["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    doc["rows"] = [*({k: v for k, v in r.items() if k != "curve"} for r in nodes),
                   *(r for r in doc["rows"] if r["source"] != "nodes")]
    doc["ratios"]["nodes_tokens_per_min_speed_over_fixed"] = round(
        speed_n["tokens_per_min"] / fixed_n["tokens_per_min"], 2)
    doc["curves"] = {**{_curve_key(r): r["curve"] for r in nodes},
                     **{k: v for k, v in doc["curves"].items() if not k.startswith("nodes/")}}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["ratios"]))
    print(f"replaced the node rows of {args.out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=150.0, help="seconds per node row (default 150)")
    ap.add_argument("--sim-rounds", type=int, default=SIM_ROUNDS,
                    help=f"rounds per simulator row (default {SIM_ROUNDS})")
    ap.add_argument("--sim-seeds", type=_seeds, default=SIM_SEEDS,
                    help=f"comma-separated seeds of the simulator rows (default {','.join(map(str, SIM_SEEDS))})")
    ap.add_argument("--sim-data", choices=("pooled", "dealt"), default="pooled",
                    help="the simulator workers' data: one pool handed out by share (as nodes lease; default) "
                    "or worker i's own shards i, i+K, ... (node/sim/hetero.py)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--work", default="runs/heterogeneous", help="testnet folders")
    ap.add_argument("--sim-only", action="store_true", help="only the simulator rows (e.g. on a GPU machine)")
    ap.add_argument("--nodes-only", action="store_true",
                    help="only the node rows, put into --out in place of its node rows (its simulator rows stay)")
    ap.add_argument("--sim-device", default="cpu", help="the simulator rows' device (default cpu)")
    ap.add_argument("--sim-model", choices=("tiny", "quality"), default="tiny",
                    help="tiny: testnet-tiny's model; quality: the quality benchmark's (a GPU)")
    ap.add_argument("--add", metavar="JSON", help="a --sim-only result to add to --out's JSON under extra_sim")
    ap.add_argument("--replace-sim", metavar="JSON", nargs="+",
                    help="--sim-only results (e.g. one a seed) that replace --out's simulator rows; its node rows stay")
    args = ap.parse_args()
    if args.replace_sim:
        return replace_sim(args)
    if args.add:
        doc, extra = json.loads(Path(args.out).read_text()), json.loads(Path(args.add).read_text())
        doc.setdefault("extra_sim", []).append(extra)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"added {args.add} to {args.out}")
        return 0
    if args.sim_only:
        return write_sim_only(args)
    load0 = os.getloadavg()
    from murmur.node.model.corpus import bundled_corpus
    from murmur.node.model.data import prepare

    with tempfile.TemporaryDirectory(prefix="murmur-hetero-data-") as tmp:
        # The bundled corpus three times (14.8M tokens), so that both rows run their whole
        # --duration: with data/shakespeare-byte alone (4.9M) a row ended when its data did (50 s
        # for the speed rule on a quiet machine), and a 50 s row's ratio swung by 15% run to run.
        data = Path(tmp) / "data"
        # Shards of data/shakespeare-byte's size: smaller ones (8192) made the nodes lease every
        # few steps, and those waits, not the rule, then held the fast node back.
        prepare(data, sources=[bundled_corpus()] * 3, tokenizer="byte", shard_tokens=262144)
        nodes = [node_row(rule, args.duration, Path(args.work) / rule, data) for rule in ("fixed", "speed")]
    compare(nodes)
    for r in nodes:
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
    fixed_n, speed_n = nodes
    if args.nodes_only:
        return replace_nodes(args, nodes, load0)
    sim = _sim_doc([r for seed in args.sim_seeds for r in sim_rows(args.sim_rounds, seed=seed, data=args.sim_data)])
    doc = {
        **_header(args, f"CPU only: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"),
        "load_average_before": [round(x, 2) for x in load0],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "rows": [*({k: v for k, v in r.items() if k != "curve"} for r in nodes), *sim["rows"]],
        "ratios": {
            "nodes_tokens_per_min_speed_over_fixed": round(speed_n["tokens_per_min"] / fixed_n["tokens_per_min"], 2),
            **sim["ratios"],
        },
        "sim_gap_vs_tokens": sim["sim_gap_vs_tokens"],
        "curves": {**{_curve_key(r): r["curve"] for r in nodes}, **sim["curves"]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["ratios"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
