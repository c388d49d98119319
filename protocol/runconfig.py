"""The run configuration: one TOML file describes a whole run.

It is part of the contract between coordinator and nodes (hence `protocol/`): the coordinator
validates it on `runs create` and hands this same file to every node, so every key is typed and
validated here, in one place. A typo or a wrong type is a one-line ``ConfigError`` naming the key, never a traceback
from deep inside the trainer.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from murmur.errors import MurmurError


class ConfigError(MurmurError):
    """A run configuration that cannot be used; the message names the key and what to do."""


@dataclass(kw_only=True, slots=True)
class ModelSection:
    preset: str = "tiny"
    # Any of these overrides the preset's value (None keeps the preset's).
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    hidden_dim: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None


@dataclass(kw_only=True, slots=True)
class DataSection:
    path: str = "data/shakespeare-byte"
    tokenizer: Literal["byte", "gpt2"] = "byte"


@dataclass(kw_only=True, slots=True)
class OptimSection:
    """The inner optimizer: AdamW with linear warm-up and cosine decay (ALGORITHMS.md)."""

    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 100


@dataclass(kw_only=True, slots=True)
class TrainSection:
    steps: int = 1000
    batch_size: int = 16
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0: only at the end
    log_every: int = 1
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on a GPU, fp32 on the CPU
    compile: bool = False


@dataclass(kw_only=True, slots=True)
class SyncSection:
    """How replicas stay together. Used by `murmur sim` and the node; ignored by `murmur train`."""

    algorithm: Literal["ddp", "diloco", "streaming", "demo"] = "diloco"
    inner_steps: int = 50  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 4  # Streaming DiLoCo: P
    overlap_steps: int = 5  # Streaming DiLoCo: tau
    mix_alpha: float = 0.0  # Streaming DiLoCo: alpha
    global_on_cpu: bool = False
    # DeMo
    demo_beta: float = 0.999
    demo_topk: int = 32
    demo_chunk: int = 64
    # The codec of the exchanged update and the aggregation rule.
    codec: str = "fp32"
    codec_block: int = 64
    topk_fraction: float = 0.0156
    powersgd_rank: int = 4
    ef_decay: float = 1.0  # error feedback: residual kept per round (SparseLoCo uses 0.95)
    aggregator: Literal["mean", "trimmed_mean", "centered_clip"] = "mean"
    trim: int = 1
    clip_tau: float = 1.0
    # The peer exchange: MB of the fp32 update per pipeline chunk. Part of the stream layout, so
    # every node of a run must use the same value (the run config is how they agree).
    exchange_chunk_mb: float = 4.0


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str = "murmur-run"
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    sync: SyncSection = field(default_factory=SyncSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


# ---------------------------------------------------------------------------------------------
# Parsing and validation


def _check_value(key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(key, value, arg)
            except ConfigError as err:
                last = err
        raise last or ConfigError(f"{key}: unexpected value {value!r}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key} = {value!r} is not one of {choices}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {annotation!r}")  # pragma: no cover


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"[{prefix}] must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            known = ", ".join(sorted(names))
            raise ConfigError(f"unknown key '{where}' (known here: {known})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        where = f"{prefix}.{f.name}" if prefix else f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, data[f.name], where)
        else:
            kwargs[f.name] = _check_value(where, data[f.name], hint)
    return cls(**kwargs)


# The model presets of node/model/transformer.py, by name (the coordinator validates without importing node/;
# a test checks that the two lists agree).
MODEL_PRESETS = ("tiny", "small", "medium", "base", "large")


def _validate(cfg: RunConfig) -> None:
    if cfg.model.preset not in MODEL_PRESETS:
        raise ConfigError(f"model.preset = {cfg.model.preset!r} is not one of {', '.join(MODEL_PRESETS)}")
    positive = {
        "train.steps": cfg.train.steps,
        "train.batch_size": cfg.train.batch_size,
        "train.eval_every": cfg.train.eval_every,
        "train.eval_batches": cfg.train.eval_batches,
        "train.log_every": cfg.train.log_every,
        "sync.inner_steps": cfg.sync.inner_steps,
        "sync.fragments": cfg.sync.fragments,
        "sync.demo_topk": cfg.sync.demo_topk,
        "sync.demo_chunk": cfg.sync.demo_chunk,
        "sync.codec_block": cfg.sync.codec_block,
        "sync.powersgd_rank": cfg.sync.powersgd_rank,
        "sync.exchange_chunk_mb": cfg.sync.exchange_chunk_mb,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if cfg.sync.exchange_chunk_mb > 8:
        raise ConfigError(
            f"sync.exchange_chunk_mb must be at most 8 (a chunk travels as one gRPC message of at most 8 MiB), "
            f"got {cfg.sync.exchange_chunk_mb:g}"
        )
    for key in ("optim.lr", "sync.outer_lr", "optim.grad_clip"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(f"{key} must not be negative")
    if cfg.train.checkpoint_every < 0 or cfg.optim.warmup_steps < 0:
        raise ConfigError("train.checkpoint_every and optim.warmup_steps must not be negative")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be within [0, 1], got {cfg.optim.min_lr_ratio}")
    if not 0.0 <= cfg.sync.mix_alpha <= 1.0:
        raise ConfigError(f"sync.mix_alpha must be within [0, 1], got {cfg.sync.mix_alpha}")
    if not 0.0 < cfg.sync.ef_decay <= 1.0:
        raise ConfigError(f"sync.ef_decay must be within (0, 1], got {cfg.sync.ef_decay}")
    if not 0.0 < cfg.sync.topk_fraction <= 1.0:
        raise ConfigError(f"sync.topk_fraction must be within (0, 1], got {cfg.sync.topk_fraction}")
    if cfg.sync.overlap_steps < 0 or cfg.sync.overlap_steps >= cfg.sync.inner_steps:
        raise ConfigError("sync.overlap_steps must be within [0, sync.inner_steps)")


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    cfg = _build(RunConfig, data, "")
    _validate(cfg)
    return cfg


def parse_config(text: str, source: str = "<config>") -> RunConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source} is not valid TOML: {err}") from None
    return config_from_dict(data)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a run TOML and apply ``section.key=value`` overrides (values parsed as TOML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    for item in overrides or []:
        apply_override(data, item)
    return config_from_dict(data)


def apply_override(data: dict[str, Any], item: str) -> None:
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
