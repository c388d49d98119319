"""`--kernels` and `--compile`: the flags that choose the GPU path of `murmur train`, `murmur node run`
and `murmur sim`.

Nothing given, each command runs the fastest combination measured on an H200
(benchmarks/results/train_throughput.json): the model compiles its own forward with torch.compile
on CUDA, the fused cross-entropy is the one Triton kernel kept under compile, and AdamW runs fused.
The flags set the same variables as the environment does (MURMUR_KERNELS, MURMUR_COMPILE; see
docs/configuration.md), so child processes (local ranks, a testnet's nodes) follow them too.
"""

from __future__ import annotations

import argparse
import os

# murmur.gpu_choice, not murmur.kernels: declaring and checking the flags must not import torch
# (`murmur node run --help` and a usage error answer before any torch import).
from murmur.gpu_choice import COMPILE_CHOICES, COMPILE_ENV, KERNELS_ENV, compile_requested, requested


def add_gpu_path_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kernels",
        metavar="CHOICE",
        help="auto (default: the fastest measured), triton, torch, or a comma-separated list of "
        f"model ops that take Triton (env {KERNELS_ENV})",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        help=f"whether the model compiles its forward with torch.compile: auto (on CUDA), on, off (env {COMPILE_ENV})",
    )


def apply_gpu_path_flags(args: argparse.Namespace) -> None:
    """Put the flags into the environment and check the result: a bad value is a one-line error
    now, not a traceback at the first forward pass."""
    if getattr(args, "kernels", None):
        os.environ[KERNELS_ENV] = args.kernels
    if getattr(args, "compile", None):
        os.environ[COMPILE_ENV] = args.compile
    requested()
    compile_requested()
