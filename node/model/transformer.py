"""A readable Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, causal attention.

The model knows nothing about communication or pipelines. Its memory-bound ops go through
`murmur.kernels`, which picks the fused Triton kernels on a GPU and the pure-torch references on
the CPU (override with MURMUR_KERNELS=triton|torch). On a GPU the forward (and so its backward)
runs through torch.compile by default, the fastest path measured (MURMUR_COMPILE=auto|on|off,
see `murmur.kernels.dispatch`); under compile only the kernels that beat Inductor stay Triton.
Initial weights depend on the seed alone: every parameter is drawn on the CPU from its own
generator, seeded from (seed, the parameter's name) (`init_parameter`), so the same seed gives the
same weights anywhere, and a pipeline stage (node/model/stages.py) draws exactly its own parameters
without building the rest of the model.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from murmur import kernels
from murmur.protocol.model_shape import PRESETS, ModelConfig, model_config  # noqa: F401 - the model's shape, re-exported


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the consumer (a matmul) reads the autocast dtype: write that directly
        # instead of an fp32 output it would cast (same values, fewer bytes).
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        return kernels.rms_norm(x, self.weight, self.eps, out_dtype)


def rotary_tables(cfg: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim // 2] for the half-split rotary layout."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float64, device=device) / half))
    t = torch.arange(cfg.seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(t, inv_freq)
    return angles.cos().float(), angles.sin().float()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.heads(x, cos, sin), causal=True)

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of ``x`` [b, t, dim], rotated: each [b, heads, t, head_dim]
        (the KV cache of `murmur generate`, node/model/kv_cache.py, keeps the keys and values)."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin)
        return tuple(z.transpose(1, 2) for z in (q, k, v))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``q`` over ``k``, ``v`` (as `heads` gives them) and the output projection."""
        b, _, t, _ = q.shape
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(kernels.swiglu(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


INIT_STD = 0.02


def parameter_seed(seed: int, name: str) -> int:
    """The seed of one parameter's draw: a hash of the run's seed and the parameter's whole-model
    name, so any subset of the parameters can be drawn alone and still match the whole model."""
    digest = hashlib.sha256(f"murmur-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_parameter(name: str, p: torch.Tensor, seed: int, n_layers: int) -> None:
    """The initial value of the parameter called ``name`` (its whole-model name), written into
    ``p`` wherever it lives. Drawn in fp32 on the CPU, one parameter at a time, so the values do
    not depend on the device and the transient cost is one parameter."""
    if name.endswith("norm.weight"):
        p.fill_(1.0)
        return
    # Residual output projections shrink with depth (GPT-2 / Llama practice).
    std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w_down.weight")) else INIT_STD
    gen = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
        torch.randn(p.shape, generator=gen, out=p.data).mul_(std)  # in place: no transient copy to fragment the heap
    else:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every weight from its own seeded draw (`init_parameter`): the seed alone decides."""
        for name, p in self.named_parameters():
            init_parameter(name, p, seed, self.cfg.n_layers)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] without targets; the mean cross-entropy with them.

        With targets the loss goes through `kernels.linear_cross_entropy`, which on a GPU never
        materializes the full [B*T, V] logits. Runs compiled where `kernels.compile_enabled`.
        """
        if kernels.compile_enabled(idx):
            return _compiled_forward()(self, idx, targets)
        return self._forward(idx, targets)

    def _forward(self, idx: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        h = self.hidden_states(idx)
        if targets is None:
            return F.linear(h, self.output_weight)
        return kernels.linear_cross_entropy(h.flatten(0, 1), self.output_weight, targets.flatten())


_COMPILED = None


def _compiled_forward():
    """One torch.compile of `Transformer._forward` for every model of the process (compiled code
    is shared between models of one shape; the module's weights are graph inputs)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(Transformer._forward)
    return _COMPILED


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    return Transformer(cfg, seed=seed).to(device)
