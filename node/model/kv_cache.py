"""Inference with a key/value cache: each new token costs one position's work instead of the whole
context's. Beside the model, not in it: training's forward (its kernels, its torch.compile graph)
stays exactly as it is; `decode` walks the same modules with the same weights and kernels, and only
the attention is restated, to write and read the cache.

The cache holds at most the model's `seq_len` positions, at positions 0.. like training's rows: what
happens when a generation outgrows it is node/export/generate.py's choice (it starts a new cache on
the last half of the text), made the same with and without the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from murmur.node.model.transformer import Attention, Transformer


class KVCache:
    """Keys and values of every layer, [B, n_kv_heads, seq_len, head_dim], filled up to `length`."""

    def __init__(self, model: Transformer, batch: int = 1) -> None:
        cfg, p = model.cfg, model.embed.weight
        shape = (batch, cfg.n_kv_heads, cfg.seq_len, cfg.head_dim)
        self.k = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layers)]
        self.v = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layers)]
        self.capacity = cfg.seq_len
        self.length = 0

    @property
    def room(self) -> int:
        return self.capacity - self.length


@torch.no_grad()
def decode(model: Transformer, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, T, V] of ``idx`` [B, T], the tokens at the cache's next positions, attending to
    the cached ones; their keys and values join the cache."""
    t, start = idx.shape[1], cache.length
    if t > cache.room:
        raise ValueError(f"{t} more tokens do not fit the cache ({cache.length} of {cache.capacity} positions used)")
    cos, sin = model.rope_cos[start : start + t], model.rope_sin[start : start + t]
    # Causal within the new tokens; every cached position lies before them. One token needs no mask.
    mask = None
    if t > 1:
        q_pos = torch.arange(start, start + t, device=idx.device)
        mask = torch.arange(start + t, device=idx.device)[None, :] <= q_pos[:, None]
    x = model.embed(idx)
    for i, block in enumerate(model.blocks):
        x = x + _attend(block.attn, block.attn_norm(x), cos, sin, mask, cache, i)
        x = x + block.mlp(block.mlp_norm(x))
    cache.length = start + t
    return F.linear(model.norm(x), model.output_weight)


def _attend(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
    cache: KVCache, layer: int,
) -> torch.Tensor:
    """`Attention.forward`, with the new keys and values written into the cache and read back whole."""
    q, k, v = attn.heads(x, cos, sin)
    end = cache.length + q.shape[2]
    cache.k[layer][:, :, cache.length : end] = k
    cache.v[layer][:, :, cache.length : end] = v
    return attn.attend(q, cache.k[layer][:, :, :end], cache.v[layer][:, :, :end], mask=mask)
