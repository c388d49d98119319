"""The run configuration: one TOML file describes a whole run.

It is part of the contract between coordinator and nodes (hence `protocol/`): the coordinator
validates it on `runs create` and hands this same file to every node, so every key is typed and
validated here, in one place. The schema is a set of pydantic models: strict types (TOML's own, no
coercion: `steps = "10"` or `steps = true` is refused), unknown keys refused, ranges and choices
declared beside each key. pydantic's errors are turned into one-line ``ConfigError``s that name the
key (``protocol/config_errors.py``), never a traceback from deep inside the trainer.
docs/configuration.md is the reference of every key; a test keeps it complete.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from murmur.errors import MurmurError

from .config_errors import describe

# The model presets of node/model/transformer.py, by name (the coordinator validates without importing node/;
# a test checks that the two lists agree).
ModelPreset = Literal["tiny", "small", "medium", "base", "large"]
MODEL_PRESETS: tuple[str, ...] = typing.get_args(ModelPreset)

# The update codecs of optim/codecs.py, by name (same reason, same kind of test).
Codec = Literal["fp32", "fp16", "bf16", "int8", "int4", "2bit", "topk", "topk2bit", "sign", "powersgd"]
CODECS: tuple[str, ...] = typing.get_args(Codec)

# The activation codecs of node/pipeline/codec.py (which takes its list from here).
ActivationCodec = Literal["fp32", "bf16", "int8"]
ACTIVATION_CODECS: tuple[str, ...] = typing.get_args(ActivationCodec)

# A pipeline chunk travels as one gRPC message, and peers accept messages of at most 8 MiB.
MAX_EXCHANGE_CHUNK_MB = 8.0
_CHUNK_WHY = {"why": "a chunk travels as one gRPC message of at most 8 MiB"}


# Upper bounds. Generous (past any run this code could train) but finite, so that an absurd number
# (``steps = 2^63``) is refused where the config is read (`admin runs create`, `train`, `sim`,
# `testnet up`) with the key's name, instead of being stored and failing on a node. Each says why in
# its error (the ``why`` below) and in docs/configuration.md's table of bounds.
MAX_STEPS = 10**9
_STEPS_WHY = "a billion steps is 30 years at one step a second"
MAX_SECONDS = 86_400.0
_SECONDS_WHY = "a day"
MAX_LAYERS = 1024


def _bounded(default: Any, limit: float, why: str, **low: Any) -> Any:
    """``Field(default, **low, le=limit)`` whose out-of-range error says ``why`` the limit is there."""
    return Field(default, le=limit, json_schema_extra={"why": why, "cap": True}, **low)


class ConfigError(MurmurError):
    """A run configuration that cannot be used; the message names the key and what to do."""


class Section(BaseModel):
    """A table of the run TOML. Mutable like a dataclass (callers adjust a parsed config in place);
    validated when built from a dict, not on each assignment."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ModelSection(Section):
    preset: ModelPreset = "tiny"
    # Any of these overrides the preset's value (None keeps the preset's).
    dim: int | None = _bounded(None, 1 << 16, "GPT-3's is 12288", gt=0)
    n_layers: int | None = _bounded(None, MAX_LAYERS, "GPT-3 has 96 blocks", gt=0)
    n_heads: int | None = _bounded(None, 1024, "GPT-3 has 96 heads", gt=0)
    n_kv_heads: int | None = _bounded(None, 1024, "GPT-3 has 96 heads", gt=0)
    hidden_dim: int | None = _bounded(None, 1 << 18, "4x the widest dim", gt=0)
    seq_len: int | None = _bounded(None, 1 << 20, "a million tokens of context", gt=0)
    vocab_size: int | None = _bounded(None, 1 << 21, "the largest tokenizers have about 256k tokens", gt=0)
    # One matrix for the embedding and the output head (true) or two (false). Left out: tied,
    # except in a run pipelined over several stages, which unties them (stage 0 holds the
    # embedding, the last stage the head: docs/pipeline.md "Tied embeddings"). Set it to false
    # in a data-parallel run or `murmur train` to train exactly a pipeline's model.
    tie_embeddings: bool | None = None


class DataSection(Section):
    path: str = "data/shakespeare-byte"
    tokenizer: Literal["byte", "gpt2"] = "byte"


class OptimSection(Section):
    """The inner optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest (MuLoCo),
    with linear warm-up and cosine decay (docs/algorithms.md)."""

    # adamw: AdamW for every parameter. muon: Muon for the 2-D matrices of the blocks, AdamW (lr,
    # weight_decay, betas below) for the embedding, the head, norms and biases (optim/muon.py).
    inner: Literal["adamw", "muon"] = "adamw"

    lr: float = _bounded(4e-4, 10.0, "AdamW moves a weight by about lr a step", ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = _bounded(0.1, 10.0, "weights shrink by lr x weight_decay a step; 0.01-0.1 is usual", ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = _bounded(1e-8, 1.0, "an eps of 1 drowns the second moment", gt=0)
    grad_clip: float = _bounded(1.0, 1e6, "a clip this high never acts: 0 turns it off", ge=0)  # 0: off
    warmup_steps: int = _bounded(100, MAX_STEPS, _STEPS_WHY, ge=0)
    # Muon (optim.inner = "muon"): its peak lr, on the same warm-up and decay as lr. With
    # muon_adjust_lr = "match_rms_adamw" an update's RMS matches AdamW's, so AdamW's lr and weight
    # decay are the starting point; "original" (Keller Jordan's scaling) wants about 50x that lr.
    muon_lr: float = _bounded(4e-4, 10.0, "Muon moves a weight by about 0.2 x lr a step (match_rms_adamw)", ge=0)
    muon_weight_decay: float = _bounded(0.1, 10.0, "weights shrink by muon_lr x muon_weight_decay a step", ge=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_nesterov: bool = True
    muon_ns_steps: int = _bounded(5, 99, "torch's Muon refuses 100 Newton-Schulz steps; 5 is the usual", gt=0)
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"


class TrainSection(Section):
    steps: int = _bounded(1000, MAX_STEPS, _STEPS_WHY, gt=0)
    batch_size: int = _bounded(16, 1 << 16, "more sequences a step than any machine holds", gt=0)
    eval_every: int = _bounded(100, MAX_STEPS, _STEPS_WHY, gt=0)
    eval_batches: int = _bounded(8, 1 << 16, "more batches an evaluation than any machine holds", gt=0)
    checkpoint_every: int = _bounded(0, MAX_STEPS, _STEPS_WHY, ge=0)  # 0: only at the end
    log_every: int = _bounded(1, MAX_STEPS, _STEPS_WHY, gt=0)
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on a GPU, fp32 on the CPU
    compile: bool = False


class SyncSection(Section):
    """How replicas stay together. Used by `murmur sim` and the node; ignored by `murmur train`."""

    algorithm: Literal["ddp", "diloco", "streaming", "demo"] = "diloco"
    inner_steps: int = _bounded(50, 10**6, "a million steps between syncs is no syncing", gt=0)  # H
    # The outer step: lr 1 with Nesterov momentum 0.5, the best measured row at every H run in
    # benchmarks/results/quality.json (4 workers, 8k tokens per worker-step: 8.5% behind DDP at H50
    # against 11.1% for the DiLoCo paper's 0.7/0.9, 11.5% against 16.0% at H250).
    outer_lr: float = _bounded(1.0, 10.0, "the outer step of DiLoCo runs is 0.7-1", ge=0)
    outer_momentum: float = Field(0.5, ge=0, lt=1)
    nesterov: bool = True
    fragments: int = _bounded(4, MAX_LAYERS, "at most one fragment a block", gt=0)  # Streaming DiLoCo: P
    # Streaming DiLoCo: tau, below inner_steps (checked below)
    overlap_steps: int = _bounded(5, 10**6, "a million steps between syncs is no syncing", ge=0)
    mix_alpha: float = Field(0.0, ge=0, le=1)  # Streaming DiLoCo: alpha
    global_on_cpu: bool = False
    # Streaming DiLoCo: how the fragments are cut. contiguous: consecutive layers per fragment;
    # strided: layer l in fragment l mod P (the paper's choice: each fragment spans the depth).
    fragment_layout: Literal["contiguous", "strided"] = "contiguous"
    # The inner lr for K workers: none keeps optim.lr; sqrt_k multiplies it by sqrt(K) (each
    # worker's AdamW step on a 1/K batch is about sqrt(K) smaller than DDP's useful step).
    inner_lr_scale: Literal["none", "sqrt_k"] = "none"
    # DiLoCo and Streaming DiLoCo with members of different speeds (optim/budget.py): fixed: H
    # inner steps each a round; speed: K*H steps a round shared by measured speed, each member's
    # pseudo-gradient weighted by its steps, a share clipped to [H/max_step_ratio, H*max_step_ratio].
    round_budget: Literal["fixed", "speed"] = "fixed"
    max_step_ratio: float = Field(4.0, ge=1, le=1000)
    # With round_budget = "speed": a member whose share is done trains on while the round's exchange
    # is in flight (waiting for the slowest member, then the all-reduce) instead of idling; those
    # steps are carried into its next window (node/daemon/window.py, StreamingDiLoCo.land).
    fill_wait: bool = True
    # DeMo
    demo_beta: float = Field(0.999, ge=0, lt=1)
    demo_topk: int = _bounded(32, 1 << 24, "a 4096x4096 chunk's coefficients", gt=0)
    demo_chunk: int = _bounded(64, 4096, "the DCT of a chunk costs chunk^3", gt=0)
    # The DCT coefficients on the wire. The paper sends fp32; bf16 tied it on the H200 (2 seeds, one
    # warm start: val 2.9906 against 2.9909, benchmarks/results/quality.json rows_run_2026_12_03_q5)
    # at 1.5x less traffic, so it is the default.
    demo_values: Literal["fp32", "bf16"] = "bf16"
    # The codec of the exchanged update and the aggregation rule.
    codec: Codec = "fp32"
    codec_block: int = _bounded(64, 1 << 21, "a pipeline chunk holds at most 2M fp32 values", gt=0)
    topk_fraction: float = Field(0.0156, gt=0, le=1)
    powersgd_rank: int = _bounded(4, 1024, "a rank this high sends more than the matrix", gt=0)
    # Error feedback (optim/codecs.py): what the codec lost is kept and added to the next round's
    # update. auto: the codec's own default (on for 2bit, sign, top-k and PowerSGD; off for the
    # casts, int8 and int4); on or off for any codec.
    error_feedback: Literal["auto", "on", "off"] = "auto"
    ef_decay: float = Field(1.0, gt=0, le=1)  # error feedback: residual kept per round (SparseLoCo uses 0.95)
    # Top-k codecs: a coordinate's aggregate is the mean over all members (one not sent counts as
    # 0: disjoint top-k sets shrink the step by 1/K) or over the members that sent it (SparseLoCo's
    # reference code). "senders" needs the aggregator "mean" (optim/reduce.py).
    sparse_average: Literal["members", "senders"] = "members"
    aggregator: Literal["mean", "trimmed_mean", "centered_clip"] = "mean"
    trim: int = _bounded(1, 1024, "values dropped at each end: more than a round's members", ge=0)
    clip_tau: float = _bounded(1.0, 1e6, "a radius this large never clips", gt=0)
    # The peer exchange: MB of the fp32 update per pipeline chunk. Part of the stream layout, so
    # every node of a run must use the same value (the run config is how they agree).
    exchange_chunk_mb: float = Field(4.0, gt=0, le=MAX_EXCHANGE_CHUNK_MB, json_schema_extra=_CHUNK_WHY)
    # A round's all-reduce runs in groups of at most this many trainers, combined into one result
    # (node/exchange/groups.py, docs/protocol.md "Groups"); a run of this many or fewer is one group.
    group_size: int = _bounded(16, 4096, "a group past a few thousand peers is the unbounded round again", ge=2)

    @model_validator(mode="after")
    def _overlap_within_round(self) -> SyncSection:
        if self.overlap_steps >= self.inner_steps:
            raise PydanticCustomError(
                "cross_field",
                "must be within [0, sync.inner_steps = {inner}), got {value}",
                {"config_key": "overlap_steps", "inner": self.inner_steps, "value": self.overlap_steps},
            )
        return self

    @model_validator(mode="after")
    def _senders_with_mean(self) -> SyncSection:
        if self.sparse_average == "senders" and self.aggregator != "mean":
            raise PydanticCustomError(
                "cross_field",
                "\"senders\" averages with the aggregator \"mean\" only, got sync.aggregator = \"{aggregator}\"",
                {"config_key": "sparse_average", "aggregator": self.aggregator},
            )
        return self


class PipelineSection(Section):
    """SWARM mode: the model cut into stages served by peers, microbatches sent through them by
    drivers (docs/pipeline.md). Absent from a run config: the data-parallel mode."""

    stages: int = _bounded(2, MAX_LAYERS, "at most one stage a block", gt=0)
    layers: list[int] | None = None  # blocks per stage; None: an even split
    # rows (sequences) per microbatch
    microbatch_size: int = _bounded(4, 1 << 16, "more rows than any stage holds", gt=0)
    activation_codec: ActivationCodec = "bf16"  # for activations and their gradients
    # Drivers the run wants: the coordinator grants a lease of a pipelined run to at most this
    # many nodes at once, so a volunteer that joins with `murmur node run --role auto` drives when
    # a lease is free under it and serves a stage otherwise (docs/pipeline.md "Joining a pipelined
    # run"). 0: no limit, and auto volunteers serve stages (drivers join with --role driver).
    drivers: int = _bounded(0, 1 << 16, "65536 drivers of one run", ge=0)
    # The longest a hop may take (forward or backward of one stage, wire included). Deadlines
    # adapt to each peer's measured latency below this; until a peer is measured this is its
    # deadline. SWARM uses 30 s forward and 75 s backward; a tiny CPU model needs far less.
    hop_timeout_s: float = _bounded(30.0, MAX_SECONDS, _SECONDS_WHY, gt=0)
    # adaptive deadlines never go below this (scheduler noise)
    min_hop_timeout_s: float = _bounded(2.0, MAX_SECONDS, _SECONDS_WHY, gt=0)
    # peers tried per hop before the microbatch is given up
    hop_attempts: int = _bounded(3, 1000, "a thousand tries of one hop", gt=0)
    # times a driver runs a failing microbatch before stopping
    microbatch_attempts: int = _bounded(3, 1000, "a thousand runs of one microbatch", gt=0)
    # Pause before re-running a failed microbatch, doubling per failure, at most 30 s: a stage
    # whose every peer is down needs time to be refilled, and re-running at once would only
    # spend the attempts.
    microbatch_retry_s: float = _bounded(1.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # How long a driver waits for a stage that no peer answers (every peer of it gone) to be
    # refilled before it stops: it stops only after ``microbatch_attempts`` failed runs of a
    # microbatch AND this long without any microbatch completing. The coordinator refills an
    # emptied stage after a heartbeat TTL and a state fetch (seconds); a stage with no peer left
    # anywhere waits for a volunteer to join, so the default is generous.
    stage_wait_s: float = _bounded(600.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # samples per stage peer per optimizer step
    target_samples: int = _bounded(16, 1 << 24, "16M samples a step", gt=0)
    rebalance_every_s: float = _bounded(60.0, MAX_SECONDS, _SECONDS_WHY, gt=0)  # the coordinator's bottleneck check
    # a failed peer is benched this long, doubling per failure in a row
    bench_s: float = _bounded(2.0, MAX_SECONDS, _SECONDS_WHY, gt=0)
    max_bench_s: float = _bounded(60.0, MAX_SECONDS, _SECONDS_WHY, gt=0)
    # Every peer of stage s keeps a copy of stage s+1's weights (the last stage: of stage 0),
    # refreshed this often, so that a stage whose every peer dies is refilled with weights at
    # most this old instead of the seed's. 0: no copies.
    replica_every_s: float = _bounded(10.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # Stage-mates sync their stage's weights (the run's codec, aggregator and outer step) beside the
    # compute (node/pipeline/stage_sync.py). 0: never. With sync_every_samples, a round's time
    # scale: its deadline is 3/4 of it, and a ledger that stood still this long with samples
    # unsynced syncs them; without, the rounds' period on the clock.
    sync_every_s: float = _bounded(30.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # A sync round each time the run's ledger passes a multiple of this many samples (sequences),
    # so that stage-mates drift apart by at most that many samples between two rounds whatever
    # the machines' speed (on the clock the same samples got one round on a fast machine and ten
    # on a slow one: the two-peer loss gap measured the machine). Every committed sample went
    # through every stage, so every peer of a stage counts the same. 0: rounds on the clock.
    sync_every_samples: int = _bounded(128, 1 << 40, "a trillion samples between two rounds", ge=0)
    # At a clean stop a stage peer waits at most this long for its stage-mates that stop too
    # (their stop marks), then runs one last sync round with them before its final checkpoint, so
    # that stage-mates stopped together checkpoint one state (node/pipeline/stop_sync.py). 0: no
    # last round. A peer without a mate waits for nothing.
    stop_sync_s: float = _bounded(10.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # A sync round exchanges its stage in parts of at most this many MiB (fp32), one after the
    # other, so what a round holds besides the training state (a part's snapshot or pseudo-
    # gradient, the exchange's copy and result, the chunks in transit) is a few parts, not a few
    # copies of the stage (node/pipeline/sync_buckets.py). 0: the whole stage at once.
    sync_bucket_mb: float = _bounded(16.0, 1 << 20, "a terabyte in one part", ge=0)
    # Stage peers with a state folder checkpoint their stage (weights, AdamW, outer state) there
    # every this many seconds of the clock, all at the same instants, so that the checkpoints of
    # one instant make a complete set of the model (node/pipeline/stage_checkpoint.py). 0: only
    # at a clean stop.
    checkpoint_every_s: float = _bounded(60.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # Checkpoint versions a stage peer keeps on disk per stage (the newest, and the newest
    # multiples of 10 periods: node/pipeline/stage_checkpoint.py). Small by default: a big stage's
    # file is GBs, and six kept a stage filled a volunteer's 64 GB disk.
    checkpoint_keep: int = _bounded(2, 1000, "a thousand versions of one stage", ge=1)
    # One gRPC message of the stage service, in MiB; a Forward or Backward payload above it
    # travels as a stream of chunks below it (node/pipeline/chunks.py). gRPC's own limit is 2 GiB.
    message_cap_mb: float = _bounded(8.0, 1024.0, "gRPC messages stop at 2 GiB", ge=0.0625)
    # The most one streamed payload (a request to a stage, or its reply) may carry, in MiB: a
    # peer refuses a larger one before taking any of it, so this bounds what one call allocates.
    max_payload_mb: float = _bounded(1024.0, 1 << 20, "a terabyte in one microbatch", gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> PipelineSection:
        if self.layers is not None and (
            len(self.layers) != self.stages or min(self.layers) < 1 or max(self.layers) > MAX_LAYERS
        ):
            raise PydanticCustomError(
                "cross_field",
                "must name 1 to {most} blocks for each of the pipeline.stages = {stages} stages, got {value}",
                {"config_key": "layers", "stages": self.stages, "value": self.layers, "most": MAX_LAYERS},
            )
        if self.min_hop_timeout_s > self.hop_timeout_s:
            raise PydanticCustomError(
                "cross_field",
                "must be at most pipeline.hop_timeout_s = {hop}, got {value}",
                {"config_key": "min_hop_timeout_s", "hop": self.hop_timeout_s, "value": self.min_hop_timeout_s},
            )
        if self.max_payload_mb < self.message_cap_mb:
            raise PydanticCustomError(
                "cross_field",
                "must be at least pipeline.message_cap_mb = {cap}, got {value}",
                {"config_key": "max_payload_mb", "cap": self.message_cap_mb, "value": self.max_payload_mb},
            )
        if self.max_bench_s < self.bench_s:
            raise PydanticCustomError(
                "cross_field",
                "must be at least pipeline.bench_s = {bench}, got {value}",
                {"config_key": "max_bench_s", "bench": self.bench_s, "value": self.max_bench_s},
            )
        return self


class KeepSection(Section):
    """What the coordinator keeps of the run's model (coordinator/keeper.py): the newest verified
    state, pulled from the nodes that hold it, beside its ledger, so that a run whose nodes have
    all gone goes on from it (docs/failure-model.md)."""

    # Pull the run's newest state at most this often (seconds; 0: keep nothing). Each pull moves
    # one copy of the global state (pipelined: of every stage) to the coordinator.
    every_s: float = _bounded(60.0, MAX_SECONDS, _SECONDS_WHY, ge=0)
    # Versions kept on the coordinator's disk (the oldest go first).
    versions: int = _bounded(2, 1000, "a thousand copies of the model", gt=0)
    # When the last holder of a state newer than the kept one leaves (SIGTERM), the coordinator
    # pulls it before it answers the leave, for at most this long (0: not at leaves).
    leave_pull_s: float = _bounded(5.0, 600.0, "a node's shutdown grace is seconds", ge=0)
    # When a node's lease ends (its shard finished, or released), the coordinator pulls the run's
    # newest state if it is newer than the kept one, but not within this many seconds of its
    # previous pull (0: not at lease ends).
    lease_pull_every_s: float = _bounded(10.0, MAX_SECONDS, _SECONDS_WHY, ge=0)


class RunConfig(Section):
    name: str = "murmur-run"
    seed: int = _bounded(0, 2**63 - 1, "a seed is a signed 64-bit integer", ge=-(2**63))
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    sync: SyncSection = Field(default_factory=SyncSection)
    pipeline: PipelineSection | None = None  # absent: data parallel
    keep: KeepSection = Field(default_factory=KeepSection)

    @model_validator(mode="after")
    def _muon_steps_itself(self) -> RunConfig:
        if self.optim.inner == "muon" and self.sync.algorithm == "demo":
            raise PydanticCustomError(
                "cross_field",
                "= \"muon\" cannot be used with sync.algorithm = \"demo\" (DeMo is the optimizer itself): "
                "use optim.inner = \"adamw\" or another sync.algorithm",
                {"config_key": "optim.inner"},
            )
        return self

    @model_validator(mode="after")
    def _untied_across_stages(self) -> RunConfig:
        if self.model.tie_embeddings and self.pipeline is not None and self.pipeline.stages > 1:
            raise PydanticCustomError(
                "cross_field",
                "must be false (or left out) when pipeline.stages = {stages} > 1: the embedding lives on "
                "stage 0 and the head on the last stage, got true",
                {"config_key": "model.tie_embeddings", "stages": self.pipeline.stages},
            )
        return self

    def embeddings_tied(self) -> bool:
        """``model.tie_embeddings``, or its default: tied unless pipelined over several stages."""
        if self.model.tie_embeddings is not None:
            return self.model.tie_embeddings
        return self.pipeline is None or self.pipeline.stages == 1

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


# ---------------------------------------------------------------------------------------------
# Reading


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe(err, RunConfig)) from None


def parse_config(text: str, source: str = "<config>") -> RunConfig:
    return config_from_dict(_read_toml(text, source))


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a run TOML and apply ``section.key=value`` overrides (values parsed as TOML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = _read_toml(path.read_text(), str(path))
    for item in overrides or []:
        apply_override(data, item)
    return config_from_dict(data)


def _read_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source} is not valid TOML: {err}") from None


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``section.key=value`` in a run dict; the value is read as TOML, a bare word as a string.
    The key is checked when the dict becomes a RunConfig, like any key of the file."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    node = data
    *parents, last = dotted.strip().split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a table")
    node[last] = value


def dump_toml(data: dict[str, Any]) -> str:
    """Write the (flat-or-one-level-nested) run dict back as TOML; None values are left out."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)

    lines = [f"{k} = {fmt(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            lines.extend(f"{kk} = {fmt(vv)}" for kk, vv in v.items() if vv is not None)
    return "\n".join(lines) + "\n"
