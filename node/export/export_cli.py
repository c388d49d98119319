"""`murmur export SOURCE --out DIR`: a run's model as a folder `transformers` loads (node/export/write.py).

Light to import: torch, safetensors and the model come in once the arguments hold up.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from murmur.errors import MurmurError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's model as a Llama folder that transformers loads",
        description="SOURCE: a checkpoint file, a node state folder, a `murmur train` run folder, "
        "a testnet folder (its newest node) or an export; or a pipelined run's stage peers' state folders "
        "(several SOURCEs, or a testnet folder with stages): the newest version every stage holds. "
        "Writes model.safetensors, config.json, "
        "generation_config.json, tokenizer files and provenance.json into --out.",
    )
    p.add_argument("source", metavar="SOURCE", nargs="*", default=[],
                   help="checkpoint file or run folder, or stage peers' folders (or none, with --coordinator: "
                   "a live run)")
    live = p.add_argument_group(
        "a live run", "with --coordinator (and the admin credential), the run's newest state is fetched from the "
        "nodes that hold it and checked against the hash they announce"
    )
    live.add_argument("--coordinator", metavar="HOST:PORT",
                      help="the coordinator's public address ($MURMUR_COORDINATOR)")
    live.add_argument("--run", default="", help="the run (default: the only active one)")
    live.add_argument("--admin-key", metavar="FILE",
                      help="the <db>.admin-key file (default $MURMUR_ADMIN_KEY_FILE or $MURMUR_ADMIN_KEY)")
    live.add_argument("--ca-cert", metavar="FILE", help="the coordinator's CA (default <db>.ca.crt beside the key)")
    p.add_argument("--out", required=True, help="folder to write (must not exist, unless --force)")
    p.add_argument("--dtype", default="run", choices=("run", "fp32", "bf16", "fp16"),
                   help="weights' dtype (default run: the dtype the run keeps its weights in, fp32)")
    p.add_argument("--force", action="store_true", help="replace an earlier export at --out")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from murmur.node.export.stage_set import load_sources
    from murmur.node.export.write import export, resolve_dtype

    if args.source and args.coordinator:
        raise MurmurError("give SOURCE or --coordinator, not both")
    if args.coordinator or not args.source:
        if not args.coordinator and not os.environ.get("MURMUR_COORDINATOR"):
            raise MurmurError("give SOURCE (a checkpoint or run folder) or --coordinator HOST:PORT for a live run")
        from murmur.node.export.live import read_live
        from murmur.protocol.admin_client import resolve

        source = read_live(resolve(args.coordinator, args.admin_key, args.ca_cert), args.run)
    else:
        source = load_sources(args.source)
    out = export(source, Path(args.out), dtype=resolve_dtype(args.dtype, source), force=args.force)
    p = source.provenance
    at = f"round {p['round']}" if p.get("round") is not None else f"step {p.get('inner_steps')}"
    if source.kind == "pipeline stages":
        at = f"checkpoint version {p['round']} of {len(p['stages'])} stages"
    n = sum(t.numel() for t in source.weights.values())
    print(f"exported {source.kind} {source.path} ({n / 1e6:.2f}M params, {at}, state {str(p.get('state_hash'))[:12]}) "
          f"to {out}")
    return 0
