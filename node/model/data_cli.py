"""`murmur data`: prepare and inspect token datasets."""

from __future__ import annotations

import argparse
import time

from murmur.node.model.data import DEFAULT_PIECE_CHARS, DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, Dataset, prepare


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare and inspect token datasets")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    prep = verbs.add_parser("prepare", help="tokenize text into shards + validation split + manifest")
    prep.add_argument("--out", required=True, help="dataset folder to write")
    prep.add_argument(
        "--source", action="append", default=None,
        help="a folder of .txt/.md/.rst/.html files (or one file; HTML is read as its prose); repeatable; "
        "default: the bundled Shakespeare",
    )
    prep.add_argument("--tokenizer", choices=["byte", "gpt2"], default="byte")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    prep.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    prep.add_argument("--shuffle-seed", type=int, default=None,
                      help="cut the files into pieces at paragraph breaks and shuffle them with this seed, so "
                      "every shard mixes the sources (default: the files in order)")
    prep.add_argument("--piece-chars", type=int, default=DEFAULT_PIECE_CHARS,
                      help="with --shuffle-seed: about how many characters a piece has (default %(default)s)")
    prep.set_defaults(func=_prepare)

    info = verbs.add_parser("info", help="show a dataset's manifest and verify its hashes")
    info.add_argument("path", metavar="DIR", help="a folder `murmur data prepare` wrote")
    info.set_defaults(func=_info)


def _prepare(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    m = prepare(args.out, args.source, args.tokenizer, args.shard_tokens, args.val_fraction, args.shuffle_seed,
                args.piece_chars)
    print(
        f"prepared {args.out}: {m['total_train_tokens']:,} train tokens in {len(m['shards'])} shards, "
        f"{m['val']['tokens']:,} validation tokens, tokenizer {m['tokenizer']} "
        f"({m['source_files']} source files, {time.perf_counter() - t0:.1f}s)"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    ds = Dataset.open(args.path)
    ds.verify()
    m = ds.manifest
    print(f"{args.path}: tokenizer {m['tokenizer']} (vocab {m['vocab_size']}), source {', '.join(m['source'])}")
    print(f"  {len(m['shards'])} shards, {m['total_train_tokens']:,} train tokens, {m['val']['tokens']:,} validation")
    print("  all hashes verify")
    return 0
