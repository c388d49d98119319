"""The pipeline's model and settings, from the run config or from the command line.

The settings are the run config's ``[pipeline]`` section (`PipelineSection` in
protocol/runconfig.py: every key typed and checked there, with the reason for each default).
A stage peer or driver that joins a run whose config has that section takes the model and the
pipeline from it; without a coordinator (the tests, a manual check) they come from the
command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import torch

from murmur.node.model.tokenizer import ByteTokenizer, GPT2Tokenizer
from murmur.node.model.transformer import ModelConfig, model_config
from murmur.node.train.build import resolve_model_config
from murmur.protocol.runconfig import PipelineSection, RunConfig

__all__ = [
    "PipelineSection", "add_device_args", "add_model_args", "autocast_of", "log_to_stderr", "message_limits",
    "model_from_args", "model_from_run", "pipeline_model_config", "refuse_model_args",
]

MIB = 1 << 20


def pipeline_model_config(preset: str, stages: int, **overrides: int | None) -> ModelConfig:
    """The preset with overrides, embeddings untied when the model spans several stages."""
    cfg = model_config(preset, **overrides)
    return dataclasses.replace(cfg, tie_embeddings=cfg.tie_embeddings and stages == 1)


def model_from_run(run: RunConfig) -> tuple[ModelConfig, PipelineSection]:
    """The model and the pipeline of a run whose config has a ``[pipeline]`` section."""
    assert run.pipeline is not None
    # The vocabulary follows the run's tokenizer as the data-parallel model's does (stage peers
    # hold no data to read it from).
    vocab = ByteTokenizer.vocab_size if run.data.tokenizer == "byte" else GPT2Tokenizer.vocab_size
    # Tied or not as the run config says (RunConfig refuses tied embeddings across several stages).
    return resolve_model_config(run, vocab), run.pipeline


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and pipeline shape, as stage peers and drivers both take it on the command line
    (without a coordinator, or joining a run whose config has no ``[pipeline]`` section)."""
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--layers", default="", help="blocks per stage, e.g. 2,2 (default: an even split)")
    ap.add_argument("--preset", default="tiny")
    for name in ("dim", "n-layers", "n-heads", "hidden-dim", "seq-len"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)


MODEL_ARGS = ("stages", "layers", "dim", "n_layers", "n_heads", "hidden_dim", "seq_len")


def refuse_model_args(args: argparse.Namespace) -> None:
    """A process joined to a pipelined run takes the model from the run config: model flags on its
    command line would be silently ignored, so they are refused by name."""
    given = [f"--{k.replace('_', '-')}" for k in MODEL_ARGS if getattr(args, k) not in (None, "")]
    if given:
        raise SystemExit(f"error: the run config sets the model and the pipeline; drop {' '.join(given)}")


def model_from_args(args: argparse.Namespace) -> tuple[ModelConfig, list[int] | None]:
    cfg = pipeline_model_config(
        args.preset, args.stages, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        n_kv_heads=args.n_heads, hidden_dim=args.hidden_dim, seq_len=args.seq_len,
    )
    layers = [int(v) for v in args.layers.split(",")] if args.layers else None
    return cfg, layers


def message_limits(pipe: PipelineSection) -> tuple[int, int]:
    """(one gRPC message, the most one streamed payload may carry) in bytes, from the run's
    ``pipeline.message_cap_mb`` and ``pipeline.max_payload_mb``: stage peers and drivers both
    take them from here."""
    return int(pipe.message_cap_mb * MIB), int(pipe.max_payload_mb * MIB)


def add_device_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu",
                    help="where the stage's weights live and compute runs: cpu (default), auto, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="auto: bf16 autocast on a GPU, fp32 on the CPU (the weights stay fp32 either way); "
                         "joined to a pipelined run, the run's train.dtype decides")


def autocast_of(dtype: str, device: torch.device) -> str | None:
    """"bf16" where the compute runs under bf16 autocast (over fp32 weights), else None."""
    return "bf16" if dtype == "bf16" or (dtype == "auto" and device.type == "cuda") else None


def log_to_stderr() -> None:
    """murmur's log lines (moves, failed sync rounds, refusals) on stderr; MURMUR_LOG_LEVEL picks
    the level (default info)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger("murmur")
    root.addHandler(handler)
    root.setLevel(os.environ.get("MURMUR_LOG_LEVEL", "info").upper())
