"""The model's shape: dimensions and the named presets, and what follows from them: parameter
count, training FLOPs per token, and the bytes DDP would send (the baseline of every "less than
DDP" ratio). Plain arithmetic, no torch: the coordinator's status page uses it too, and
node/model/transformer.py builds the modules from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        d, h, kv = self.dim, self.hidden_dim, self.n_kv_heads * self.head_dim
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * h + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + d

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6N plus attention), for model FLOPs utilization."""
        n = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        return 6 * n + 12 * self.n_layers * self.dim * self.seq_len


# Byte-level vocabulary for tiny/small; the GPT-2 BPE (50257, padded to 50304) for base/large.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=352, vocab_size=256, seq_len=128),
    "small": ModelConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=8, hidden_dim=704, vocab_size=256, seq_len=256),
    "medium": ModelConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=8, hidden_dim=1408, vocab_size=50304, seq_len=512
    ),
    "base": ModelConfig(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048, vocab_size=50304, seq_len=1024
    ),
    "large": ModelConfig(
        dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, hidden_dim=2816, vocab_size=50304, seq_len=1024
    ),
}


def model_config(preset: str, **overrides: int | None) -> ModelConfig:
    base = PRESETS[preset]
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def ddp_bytes(n_params: int, k: int, steps: int) -> int:
    """Bytes one of ``k`` workers sends over ``steps`` steps of DDP: a ring all-reduce of fp32
    gradients every step, in which each worker sends 2 (k - 1) / k of the gradient."""
    return steps * (2 * (k - 1) * 4 * n_params // k) if k > 1 else 0
