"""`murmur train`: the command line; the training itself is node/train/trainer.py.

Kept apart from the trainer, which imports torch and the model, so that `murmur train --help`, a
bad flag and a bad run config answer without seconds of torch imports: the trainer is imported
once the command line and the run config hold up.
"""

from __future__ import annotations

import argparse

from murmur.node.train.gpu_path import add_gpu_path_flags, apply_gpu_path_flags
from murmur.node.train.overrides import add_set_flag, config_from_args

# The shortcut flags, applied before --set (node/train/overrides.py: --set wins).
SHORTCUTS = {"steps": "train.steps", "data": "data.path", "preset": "model.preset"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train one model on this machine")
    p.add_argument("--config", help="run TOML (default: built-in defaults)")
    add_set_flag(p)
    p.add_argument("--steps", type=int, help="shortcut for --set train.steps=N")
    p.add_argument("--data", help="shortcut for --set data.path=DIR")
    p.add_argument("--preset", help="shortcut for --set model.preset=NAME")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", help="run folder for checkpoints (default runs/<name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    add_gpu_path_flags(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    apply_gpu_path_flags(args)
    cfg = config_from_args(args, SHORTCUTS)
    from murmur.node.train.trainer import train  # torch and the model: only to train

    return train(cfg, device=args.device, out=args.out, resume=args.resume)
