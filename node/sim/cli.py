"""`murmur sim`: K workers of a low-communication run in one process, on one device.

Each worker is a real replica (weights, AdamW, data loader on its own shards as the coordinator
would lease them) driven by the same `optim` sync code a node runs; the workers meet in an
`InProcessGroup`, which counts every payload byte by codec. Worker 0 reports a progress line per
outer step (every H inner steps) and evaluates on the validation split.

Two engines run the inner steps. ``stacked`` (the default, node/sim/stacked.py) keeps the K
replicas' weights in [K, ...] tensors and trains them with one vmapped step; ``threads``
(node/sim/threaded.py) gives each replica its own module and thread, as separate nodes would run.
They agree to float rounding (tests/test_sim_stacked.py); stacked is many times faster on a GPU.

    murmur sim --config RUN.toml --workers 8 --algorithm diloco --inner-steps 100 --codec int4 --out runs/x

``--out`` gets sim.json (config, curves of validation loss against steps, tokens and bytes, the
summary) and sim.png (validation loss against bytes sent per worker, log scale).

``--speeds 1,1,2,4`` runs workers of different speeds (slowdown factors, one per worker; node/sim/
hetero.py): train.steps / H rounds under the run's ``sync.round_budget`` (fixed: H steps each, the
slowest sets the round; speed: K*H steps shared by speed), on a simulated clock; it prints the
validation loss against simulated time and tokens, and writes hetero.json to ``--out``.

``--seeds 2`` (seeds 0 and 1) or ``--seeds 0,3,7`` runs the same configuration once per seed (the
initial weights and each worker's data differ) and reports the mean validation loss and its
spread, half the range, beside each seed's run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Only what declaring the flags and checking them needs is imported here; torch, the model and the
# engines once the command runs (_run), so `murmur sim --help` and a bad flag answer at once.
from murmur.node.sim.errors import SimError
from murmur.node.train.gpu_path import add_gpu_path_flags, apply_gpu_path_flags
from murmur.node.train.overrides import add_set_flag, config_from_args

# The engines' names: the keys of node/sim/run.py's ENGINES, which imports torch
# (tests/test_startup.py checks that the two agree).
ENGINE_NAMES = ("stacked", "threads")

# The shortcut flags, applied before --set (node/train/overrides.py: --set wins).
SHORTCUTS = {
    "algorithm": "sync.algorithm", "codec": "sync.codec", "aggregator": "sync.aggregator", "data": "data.path",
    "inner_steps": "sync.inner_steps", "steps": "train.steps",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate K workers of a low-communication run in one process")
    p.add_argument("--config", help="run TOML (default: built-in defaults)")
    p.add_argument("--workers", "-k", type=int, default=4, help="replicas (default 4)")
    p.add_argument("--algorithm", choices=("ddp", "diloco", "streaming", "demo"), help="sync.algorithm")
    p.add_argument("--inner-steps", "-H", type=int, help="sync.inner_steps (H)")
    p.add_argument("--codec", help="sync.codec (fp32, fp16, bf16, int8, int4, 2bit, topk, topk2bit, sign, powersgd)")
    p.add_argument("--aggregator", help="sync.aggregator (mean, trimmed_mean, centered_clip)")
    p.add_argument("--steps", type=int, help="train.steps (inner steps per worker)")
    p.add_argument("--data", help="data.path")
    add_set_flag(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--engine", choices=ENGINE_NAMES, default="stacked",
                   help="stacked: one vmapped step for all replicas (default); threads: a thread per replica")
    p.add_argument("--init-from", metavar="CKPT",
                   help="start every replica from a murmur train checkpoint (weights and AdamW state): a warm start")
    p.add_argument("--seeds", help="N (seeds 0..N-1) or a comma-separated list: one run per seed, mean and spread")
    p.add_argument("--out", help="folder for sim.json and sim.png")
    p.add_argument("--speeds", help="workers of different speeds: slowdown factors, e.g. 1,1,2,4 (sets --workers)")
    add_gpu_path_flags(p)
    p.set_defaults(func=_run)


def parse_seeds(text: str) -> list[int]:
    """``N`` -> 0..N-1; ``a,b,c`` -> those seeds (distinct)."""
    try:
        items = [int(x) for x in text.split(",")]
    except ValueError:
        raise SimError(f"--seeds wants N or a comma-separated list of integers, got {text!r}") from None
    if len(items) == 1:
        if items[0] < 1:
            raise SimError(f"--seeds N must be at least 1, got {items[0]}")
        return list(range(items[0]))
    if len(set(items)) != len(items) or min(items) < 0:
        raise SimError(f"--seeds lists distinct non-negative seeds, got {text!r}")
    return items


def _run(args: argparse.Namespace) -> int:
    apply_gpu_path_flags(args)
    if args.workers < 1:
        raise SimError(f"--workers must be at least 1, got {args.workers}")
    cfg = config_from_args(args, SHORTCUTS)
    if args.speeds:
        return _run_speeds(args, cfg)
    # torch, the model and the engines: only once the command line and the run config hold up.
    from murmur.node.sim.replicas import read_warm_start
    from murmur.node.sim.report import format_seeds, format_table, seed_summary, write_outputs
    from murmur.node.sim.run import run_sim
    from murmur.node.train.build import open_run_dataset, resolve_device
    from murmur.optim.factory import check_sync_config

    check_sync_config(cfg.sync)
    device = resolve_device(args.device)
    dataset = open_run_dataset(cfg)
    init = read_warm_start(args.init_from) if args.init_from else None
    seeds = parse_seeds(args.seeds) if args.seeds else [cfg.seed]
    results = []
    for seed in seeds:
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.seed = seed
        results.append(run_sim(run_cfg, args.workers, device, dataset, engine=args.engine, init=init))
    print(format_table(results))
    summary = seed_summary(results, seeds) if args.seeds else None
    if summary:
        print(format_seeds(summary))
    if args.out:
        write_outputs(Path(args.out), cfg, results, summary)
        print(f"wrote {Path(args.out) / 'sim.json'} and {Path(args.out) / 'sim.png'}")
    return 0


def _run_speeds(args: argparse.Namespace, cfg) -> int:  # noqa: ANN001 - a RunConfig
    import json

    from murmur.node.sim.hetero import parse_speeds, run_hetero
    from murmur.node.train.build import open_run_dataset, resolve_device
    from murmur.optim.factory import check_sync_config

    speeds = parse_speeds(args.speeds)
    check_sync_config(cfg.sync)
    rounds = max(1, cfg.train.steps // cfg.sync.inner_steps)
    every = max(1, round(cfg.train.eval_every / cfg.sync.inner_steps))
    result = run_hetero(cfg, speeds, resolve_device(args.device), open_run_dataset(cfg), rounds=rounds,
                        eval_every_rounds=every)
    busy = " ".join(f"{b:.0%}" for b in result.busy)
    print(f"{result.rule}: {result.tokens:,} tokens in {result.time:,.0f} step-times | busy {busy} | "
          f"val {result.curve[-1].val_loss:.4f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "hetero.json").write_text(json.dumps({"config": cfg.to_dict(), **result.to_dict()}, indent=1))
        print(f"wrote {out / 'hetero.json'}")
    return 0
