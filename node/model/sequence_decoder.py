"""Incremental decoding of one fp32 sequence: the KV cache's fast path for `murmur generate`.

`kv_cache.decode` walks the model's own modules, so each new token pays for every module call,
every kernel dispatch decision (kernels/dispatch.py reads the environment at every op), RMSNorm's
autocast checks, three matmuls where one would do and the general attention's mask handling. At
batch 1 on the CPU that per-op overhead, not the math, set the rate of the tiny model: about 550 us
a token, of which the matmuls took 15% (cProfile; benchmarks/generate.py). `SequenceDecoder` makes
those choices once, when a generate call builds it, and arranges the weights so that a token costs
few torch ops (about 190 us at tiny size):

- the query, key and value projections are one matmul and the MLP's gate and up projections
  another, over weights concatenated once; each RMSNorm's weight is folded into the projection that
  reads it, and the attention's 1/sqrt(head_dim) into the query rows, so a norm is one scale;
- the rotary embedding is a roll and one fused multiply-add, x * cos + roll(x) * sin, in place;
- the residual adds ride in the output projections' matmuls (`addmm`);
- the rotated keys and the values land side by side in the projection's output, so one copy writes
  a position into the cache, preallocated for the model's whole context;
- one token's embedding is a view of its row, and its attention is two small matmuls and a softmax.

The copies cost memory while a generation runs: the query, key and value weights, the gate and up
weights and the output matrix, 0.7x the model's weights for the tiny and small presets (2.3 MB for
tiny), 0.8x for base. fp32 only: the arrangement rounds differently from the references, by a few
ulp in fp32, which would show in bf16, where `kv_cache.decode` keeps the kernels' own numerics.
The logits equal the model's forward to 1e-5 (tests/test_sequence_decoder.py); training's forward
and its kernels are untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from murmur.node.model.transformer import Block, Transformer


class _Layer:
    """One block's weights as the decoder reads them (transposed for `mm`, norms folded in)."""

    def __init__(self, block: Block, head_dim: int) -> None:
        attn, mlp = block.attn, block.mlp
        q = attn.wq.weight / math.sqrt(head_dim)  # the attention's scale, applied once here
        qk = torch.cat([q, attn.wk.weight])
        # Output columns: queries, keys, values (keys and values contiguous: one cache write).
        w = torch.cat([qk, attn.wv.weight])
        self.w_qkv = (w * block.attn_norm.weight).t().contiguous()  # [in, out]: the faster mm at one row
        self.w_o = attn.wo.weight.t()
        self.w_gate_up = (torch.cat([mlp.w_gate.weight, mlp.w_up.weight]) * block.mlp_norm.weight).t().contiguous()
        self.w_down = mlp.w_down.weight.t()
        self.hidden = mlp.w_gate.weight.shape[0]


class SequenceDecoder:
    """Logits of one sequence (batch 1, fp32 weights), a chunk of tokens at a time, with its own KV
    cache of the model's `seq_len` positions. Build one per generation and `reset` it to start the
    sequence over; the model must not change while it is in use (some weights are copies)."""

    def __init__(self, model: Transformer) -> None:
        cfg, p = model.cfg, model.embed.weight
        if p.dtype != torch.float32:
            raise ValueError(f"SequenceDecoder decodes fp32 weights, not {p.dtype} (use kv_cache.decode)")
        self.device = p.device
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dim, self.capacity, self.eps = cfg.dim, cfg.seq_len, cfg.norm_eps
        kv, d = self.n_kv_heads, self.head_dim
        with torch.no_grad():
            self.layers = [_Layer(block, d) for block in model.blocks]
            self.embed = p.detach()
            self.out = (model.output_weight * model.norm.weight).t().contiguous()
            # Rotation of the half-split layout (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) as
            # x * cos2 + roll(x) * sin2, roll(x) = (x2, x1).
            cos, sin = model.rope_cos.float(), model.rope_sin.float()
            self.cos2 = torch.cat([cos, cos], dim=-1)[:, None, :]  # [seq_len, 1, head_dim]
            self.sin2 = torch.cat([-sin, sin], dim=-1)[:, None, :]
        # Per layer and position: the rotated key heads, then the value heads, as the projection
        # writes them. The views below read them as [kv_heads, positions, head_dim].
        self.cache = torch.empty(len(self.layers), self.capacity, 2 * kv * d, device=self.device)
        self.keys = [c[:, : kv * d].view(-1, kv, d).transpose(0, 1) for c in self.cache]
        self.values = [c[:, kv * d :].view(-1, kv, d).transpose(0, 1) for c in self.cache]
        self.eps_tensor = torch.full((1, 1), self.eps, device=self.device)
        self.length = 0

    @property
    def room(self) -> int:
        return self.capacity - self.length

    def reset(self) -> None:
        self.length = 0

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Logits [V] after one more token."""
        return self._forward(self.embed[token : token + 1])

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Logits [V] after the tokens (a prompt's prefill: they attend to each other causally)."""
        if not tokens:
            raise ValueError("no tokens to feed")
        return self._forward(F.embedding(torch.tensor(tokens, device=self.device), self.embed))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        t, start = x.shape[0], self.length
        if t > self.room:
            raise ValueError(f"{t} more tokens do not fit the cache ({start} of {self.capacity} positions used)")
        end = start + t
        cos, sin = self.cos2[start:end], self.sin2[start:end]
        for i, layer in enumerate(self.layers):
            x = self._attention(i, layer, x, cos, sin, start)
            x = self._mlp(layer, x)
        self.length = end
        x = x[-1:]
        return torch.mm(x, self.out).mul_(self._inv_rms(x))[0]

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        """1 / sqrt(mean(x^2) + eps) per row [t, 1]: the norm whose weight the next matmul holds."""
        if x.shape[0] == 1:  # one row: its dot product with itself is one small matmul
            return torch.addmm(self.eps_tensor, x, x.t(), alpha=1 / self.dim).rsqrt_()
        return x.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()

    def _attention(self, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   start: int) -> torch.Tensor:
        t, h, kv, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        end = start + t
        proj = torch.mm(x, layer.w_qkv).mul_(self._inv_rms(x))
        qk = proj[:, : (h + kv) * d].view(t, h + kv, d)
        torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin, out=qk)  # rotated in place
        self.cache[i, start:end] = proj[:, h * d :]
        keys, values = self.keys[i][:, :end], self.values[i][:, :end]
        if t == 1:  # [kv_heads, query heads per kv head, head_dim]: grouped heads share their keys
            q = proj[:, : h * d].view(kv, h // kv, d)
            scores = torch.bmm(q, keys.transpose(1, 2))
            y = torch.bmm(torch.softmax(scores, dim=-1), values).view(1, h * d)
        else:
            q = proj[:, : h * d].view(t, h, d).transpose(0, 1)
            mask = None
            if start > 0:  # causal within the new tokens, every cached position before them
                q_pos = torch.arange(start, end, device=self.device)
                mask = torch.arange(end, device=self.device)[None, :] <= q_pos[:, None]
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=start == 0,
                                               scale=1.0, enable_gqa=kv != h)
            y = y.transpose(0, 1).reshape(t, h * d)
        return torch.addmm(x, y, layer.w_o)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.mm(x, layer.w_gate_up).mul_(self._inv_rms(x))
        return torch.addmm(x, F.silu(gate_up[:, : layer.hidden]) * gate_up[:, layer.hidden :], layer.w_down)
