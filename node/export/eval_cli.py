"""`murmur eval SOURCE --data DIR`: validation loss, perplexity and tokens/s (node/export/evaluate.py).

Light to import: torch and the model come in once the arguments hold up.
"""

from __future__ import annotations

import argparse

from murmur.node.export.threads import add_threads_flag, check_threads


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss and perplexity of a checkpoint or export",
        description="SOURCE: a checkpoint file, a run or testnet folder, or an export (murmur export). "
        "The loss is computed on DIR's validation split as the run's own validation computes it.",
    )
    p.add_argument("source", metavar="SOURCE", help="checkpoint file, run folder or export folder")
    p.add_argument("--data", required=True, help="prepared dataset folder (murmur data prepare)")
    p.add_argument("--batch-size", type=int, help="rows per batch (default: the run's train.batch_size)")
    p.add_argument("--batches", type=int, help="validation batches (default: the run's train.eval_batches)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"),
                   help="compute dtype (default: the run's train.dtype; auto is bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--output", choices=("text", "json"), default="text")
    add_threads_flag(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from murmur.errors import MurmurError

    for flag in ("batch_size", "batches"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise MurmurError(f"--{flag.replace('_', '-')} must be at least 1")
    check_threads(args.threads)
    from murmur.node.export.evaluate import evaluate_source, run_defaults
    from murmur.node.export.source import load_source
    from murmur.node.export.threads import use_threads
    from murmur.node.model.data import Dataset
    from murmur.node.train.build import resolve_device

    device = resolve_device(args.device)
    threads = use_threads(args.threads, device)
    source = load_source(args.source)  # an export's or a checkpoint's checksum is checked here
    source.check_finite()
    batch, batches, dtype = run_defaults(source)
    r = evaluate_source(
        source, Dataset.open(args.data), device,
        batch_size=args.batch_size or batch, batches=args.batches or batches, dtype=args.dtype or dtype,
    )
    if args.output == "json":
        print(json.dumps({"loss": r.loss, "perplexity": r.perplexity, "tokens": r.tokens, "seconds": r.seconds,
                          "tokens_per_s": r.tokens_per_s, "device": str(device), "threads": threads}))
    else:
        print(f"val loss {r.loss:.4f} | perplexity {r.perplexity:.2f} | {r.tokens:,} tokens in {r.seconds:.2f}s "
              f"({r.tokens_per_s:,.0f} tok/s) on {device}, {_threads(threads)}")
    return 0


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")
