"""The pipeline's settings, typed and checked in one place.

This is what the run config's ``[pipeline]`` section will carry (absent: today's data-parallel
mode); until that section exists the stage peers and drivers take it from their command line.
Every timeout is here, named, with the reason for its default.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from murmur.node.model.transformer import ModelConfig, model_config
from murmur.node.pipeline.codec import ACTIVATION_CODECS


class PipelineConfigError(ValueError):
    pass


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    stages: int
    layers: list[int] | None = None  # blocks per stage; None: an even split
    microbatch_size: int = 4  # rows (sequences) per microbatch
    activation_codec: str = "bf16"  # fp32 | bf16 | int8, for activations and their gradients
    # The longest a hop may take (forward or backward of one stage, wire included). Deadlines
    # adapt to each peer's measured latency below this; until a peer is measured this is its
    # deadline. SWARM uses 30 s forward and 75 s backward; a tiny CPU model needs far less.
    hop_timeout_s: float = 30.0
    min_hop_timeout_s: float = 2.0  # adaptive deadlines never go below this (scheduler noise)
    hop_attempts: int = 3  # peers tried per hop before the microbatch is given up
    microbatch_attempts: int = 3  # times a driver runs a failing microbatch before stopping
    # Pause before re-running a failed microbatch, doubling per failure, at most 30 s: a stage
    # whose every peer is down needs time to be refilled, and re-running at once would only
    # spend the attempts.
    microbatch_retry_s: float = 1.0
    target_samples: int = 16  # samples per stage peer per optimizer step
    rebalance_every_s: float = 60.0  # the coordinator's rebalancing check
    bench_s: float = 2.0  # a failed peer is benched this long, doubling per failure in a row
    max_bench_s: float = 60.0

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise PipelineConfigError(f"pipeline.stages must be at least 1, not {self.stages}")
        if self.layers is not None and len(self.layers) != self.stages:
            raise PipelineConfigError(
                f"pipeline.layers names {len(self.layers)} stages, pipeline.stages is {self.stages}"
            )
        if self.activation_codec not in ACTIVATION_CODECS:
            raise PipelineConfigError(
                f"pipeline.activation_codec {self.activation_codec!r}: use one of {', '.join(ACTIVATION_CODECS)}"
            )
        for name in ("microbatch_size", "hop_attempts", "microbatch_attempts", "target_samples"):
            if getattr(self, name) < 1:
                raise PipelineConfigError(f"pipeline.{name} must be at least 1")
        if not 0 < self.min_hop_timeout_s <= self.hop_timeout_s:
            raise PipelineConfigError("pipeline.min_hop_timeout_s must be in (0, hop_timeout_s]")
        if self.microbatch_retry_s < 0:
            raise PipelineConfigError("pipeline.microbatch_retry_s must be >= 0")
        if self.rebalance_every_s <= 0 or self.bench_s <= 0 or self.max_bench_s < self.bench_s:
            raise PipelineConfigError("pipeline.rebalance_every_s, bench_s > 0 and max_bench_s >= bench_s")


def pipeline_model_config(preset: str, stages: int, **overrides: int | None) -> ModelConfig:
    """The preset with overrides, embeddings untied when the model spans several stages."""
    cfg = model_config(preset, **overrides)
    return dataclasses.replace(cfg, tie_embeddings=cfg.tie_embeddings and stages == 1)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and pipeline shape, as stage peers and drivers both take it on the command line."""
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--layers", default="", help="blocks per stage, e.g. 2,2 (default: an even split)")
    ap.add_argument("--preset", default="tiny")
    for name in ("dim", "n-layers", "n-heads", "hidden-dim", "seq-len"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)


def model_from_args(args: argparse.Namespace) -> tuple[ModelConfig, list[int] | None]:
    cfg = pipeline_model_config(
        args.preset, args.stages, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        n_kv_heads=args.n_heads, hidden_dim=args.hidden_dim, seq_len=args.seq_len,
    )
    layers = [int(v) for v in args.layers.split(",")] if args.layers else None
    return cfg, layers
