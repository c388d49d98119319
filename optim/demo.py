"""DeMo, decoupled momentum (Peng et al. 2024): each step, send only the few largest DCT
coefficients of the momentum and keep the rest in it (error feedback); apply the sign of the
mean of everyone's coefficients.

Per parameter, each step:
    m = beta * m + lr * g
    C = DCT-II of m over chunks (c x c tiles for matrices, c-long pieces for vectors)
    keep the k largest |C| of each chunk -> (int16 positions, values): the wire
        (values bf16 by default, or fp32 as the paper's algorithm has them, by ``demo_values``: bf16
        rounds the small ones, and near zero a rounded mean can take the other sign; on the H200 the
        two tied at 8k tokens per worker-step)
    m = m - IDCT(sparse kept C)                       # what was sent leaves the momentum
    all-gather every member's wire; Q = IDCT(mean of the scattered coefficients, sorted peer order)
    p = p * (1 - lr * wd)  (matrices only);  p = p - lr * sign(Q)

The chunk along a dimension is the largest divisor of its size that is <= ``demo_chunk``, so every
tensor tiles exactly (50304 rows -> 48, 384 columns -> 64).

Parameters of one shape (every layer's wq, every layer's norm, ...) are handled as one group: their
momenta live in one [G, ...] buffer and each step's DCT, top-k, decode and mean run once per group
instead of once per tensor. The wire is unchanged (one payload per parameter). The 56 tensors of
the 6-layer quality-benchmark model fall into 5 groups; on a small model the per-tensor kernel
launches were most of DeMo's cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from murmur.optim.codecs import Codec, CodecError
from murmur.optim.exchange import Exchange, GatherResult
from murmur.optim.sync import ROUND_TIMEOUT_S, NamedParams, SyncAlgorithm
from murmur.optim.wire import WireTensor


@lru_cache(maxsize=64)
def _dct_matrix_cpu(n: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (n x n): C = D @ x, x = D.T @ C."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.float()


_DEVICE_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def dct_matrix(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = _dct_matrix_cpu(n).to(device)
    return _DEVICE_CACHE[key]


def chunk_size(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def chunk_shape(shape: tuple[int, ...], limit: int) -> tuple[int, int]:
    """(rows, cols) of a chunk; vectors are one row."""
    if len(shape) == 1:
        return 1, chunk_size(shape[0], limit)
    rows, cols = shape[0], math.prod(shape[1:])
    return chunk_size(rows, limit), chunk_size(cols, limit)


def _matrix_dims(shape: tuple[int, ...]) -> tuple[int, int]:
    return (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))


def group_dct(x: torch.Tensor, shape: tuple[int, ...], cr: int, cc: int) -> torch.Tensor:
    """[G, *shape] -> DCT coefficients [G, tiles, cr*cc], tiles of cr x cc in row-major order."""
    g, (r, c) = x.shape[0], _matrix_dims(shape)
    tiles = x.float().reshape(g, r // cr, cr, c // cc, cc).permute(0, 1, 3, 2, 4).reshape(g, -1, cr, cc)
    dr, dc = dct_matrix(cr, x.device), dct_matrix(cc, x.device)
    return (dr @ tiles @ dc.T).reshape(g, tiles.shape[1], cr * cc)


def group_idct(coef: torch.Tensor, shape: tuple[int, ...], cr: int, cc: int) -> torch.Tensor:
    """Inverse of `group_dct`: [G, tiles, cr*cc] -> [G, *shape]."""
    g, (r, c) = coef.shape[0], _matrix_dims(shape)
    dr, dc = dct_matrix(cr, coef.device), dct_matrix(cc, coef.device)
    tiles = dr.T @ coef.reshape(g, -1, cr, cc) @ dc
    return tiles.reshape(g, r // cr, c // cc, cr, cc).permute(0, 1, 3, 2, 4).reshape(g, *shape)


def dct_chunked(x: torch.Tensor, cr: int, cc: int) -> torch.Tensor:
    """One tensor's coefficients [tiles, cr*cc]."""
    return group_dct(x.unsqueeze(0), tuple(x.shape), cr, cc)[0]


def idct_chunked(coef: torch.Tensor, shape: tuple[int, ...], cr: int, cc: int) -> torch.Tensor:
    return group_idct(coef.unsqueeze(0), shape, cr, cc)[0]


VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def top_coefficients(
    coef: torch.Tensor, k: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest |coefficients| of each chunk (last dim): sorted positions, values as ``dtype``."""
    idx = coef.abs().topk(min(k, coef.shape[-1]), dim=-1, sorted=False).indices.sort(dim=-1).values
    return idx, coef.gather(-1, idx).to(dtype)


class DCTTopKCodec(Codec):
    """DeMo's compressor: top-k DCT coefficients per chunk. Error feedback lives in DeMo's momentum."""

    name = "demo_dct"
    dense = False

    def __init__(self, topk: int, chunk: int, values: str = "fp32") -> None:
        super().__init__(error_feedback=False)
        if values not in VALUE_DTYPES:
            raise CodecError(f"DeMo values travel as {' or '.join(VALUE_DTYPES)}, not {values!r}")
        self.topk, self.chunk, self.value_dtype = topk, chunk, VALUE_DTYPES[values]

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        cr, cc = chunk_shape(tuple(x.shape), self.chunk)
        idx, values = top_coefficients(dct_chunked(x, cr, cc), self.topk, self.value_dtype)
        parts = {"indices": idx.to(torch.int16), "values": values}
        return WireTensor(self.name, (), "", parts, {"chunk_rows": cr, "chunk_cols": cc})

    @staticmethod
    def out_of_range(wire: WireTensor) -> torch.Tensor:
        """A 0-d bool tensor: does the payload name positions outside its chunks? Kept on the
        device so a caller can check many payloads with one synchronization."""
        idx = wire.parts["indices"]
        n = int(wire.meta["chunk_rows"]) * int(wire.meta["chunk_cols"])
        return ((idx < 0) | (idx >= n)).any()

    def coefficients(self, wire: WireTensor, checked: bool = False) -> torch.Tensor:
        """The dense coefficient array [chunks, cr*cc] of a payload (zeros where nothing was sent)."""
        idx = wire.parts["indices"].long()
        cr, cc = int(wire.meta["chunk_rows"]), int(wire.meta["chunk_cols"])
        if idx.shape[1] > cr * cc or (not checked and bool(self.out_of_range(wire))):
            raise CodecError("DCT payload has positions outside its chunk")
        out = torch.zeros(idx.shape[0], cr * cc, device=idx.device)
        return out.scatter_(1, idx, wire.parts["values"].float())

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        cr, cc = int(wire.meta["chunk_rows"]), int(wire.meta["chunk_cols"])
        return idct_chunked(self.coefficients(wire), tuple(wire.shape), cr, cc)


@dataclass(slots=True)
class _Group:
    """Parameters of one shape: their indices, chunking, and momenta in one [G, *shape] buffer."""

    members: list[int]
    shape: tuple[int, ...]
    cr: int
    cc: int
    momentum: torch.Tensor


class DeMo(SyncAlgorithm):
    name = "demo"
    replaces_optimizer = True

    def __init__(
        self,
        params: NamedParams,
        sync_cfg,
        exchange: Exchange,
        *,
        weight_decay: float = 0.0,
        round_timeout_s: float = ROUND_TIMEOUT_S,
    ) -> None:
        super().__init__(params, sync_cfg, exchange, round_timeout_s=round_timeout_s)
        self.beta = sync_cfg.demo_beta
        self.weight_decay = weight_decay
        self.codec = DCTTopKCodec(sync_cfg.demo_topk, sync_cfg.demo_chunk, sync_cfg.demo_values)
        by_shape: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            by_shape.setdefault((tuple(p.shape), p.device), []).append(i)
        self.groups: list[_Group] = []
        self.momentum: list[torch.Tensor] = [None] * len(self.params)  # per parameter: views of the buffers
        for (shape, device), members in by_shape.items():
            cr, cc = chunk_shape(shape, sync_cfg.demo_chunk)
            buf = torch.zeros(len(members), *shape, dtype=torch.float32, device=device)
            self.groups.append(_Group(members, shape, cr, cc, buf))
            for g, i in enumerate(members):
                self.momentum[i] = buf[g]
        self._decay = [p for p in self.params if p.dim() >= 2]

    @torch.no_grad()
    def optimizer_step(self, step: int, lr: float) -> None:
        wires: list[WireTensor] = [None] * len(self.params)
        for grp in self.groups:
            grads = [self.params[i].grad for i in grp.members]
            grp.momentum.mul_(self.beta)
            if all(g is not None for g in grads):
                grp.momentum.add_(torch.stack(grads).float(), alpha=lr)
            else:
                for g, grad in zip(grp.momentum, grads, strict=True):
                    if grad is not None:
                        g.add_(grad.float(), alpha=lr)
            coef = group_dct(grp.momentum, grp.shape, grp.cr, grp.cc)
            idx, values = top_coefficients(coef, self.codec.topk, self.codec.value_dtype)
            # Error feedback: what was sent (as sent, in the wire's type) leaves the momentum.
            sent = torch.zeros_like(coef).scatter_(2, idx, values.float())
            grp.momentum.sub_(group_idct(sent, grp.shape, grp.cr, grp.cc))
            idx16 = idx.to(torch.int16)
            meta = {"chunk_rows": grp.cr, "chunk_cols": grp.cc}
            for g, i in enumerate(grp.members):
                parts = {"indices": idx16[g], "values": values[g]}
                wires[i] = WireTensor(self.codec.name, grp.shape, "float32", parts, dict(meta))
        result: GatherResult = self._wait(self.exchange.all_gather(wires, round_id=step, key="demo"))
        directions = result.memo.get("demo_sign", lambda: self._mean_directions(result, wires))
        if self.weight_decay and self._decay:
            torch._foreach_mul_(self._decay, 1 - lr * self.weight_decay)
        torch._foreach_add_(self.params, directions, alpha=-lr)
        self.outer_steps += 1

    def _mean_directions(self, result: GatherResult, wires: list[WireTensor]) -> list[torch.Tensor]:
        """sign(IDCT(mean of every member's coefficients)) per parameter: the step direction."""
        peers = sorted(result.updates)  # a fixed order
        # Untrusted positions would crash the scatter: check every payload, one sync for all.
        if any(len(result.updates[peer]) != len(wires) for peer in peers) or (
            wires and bool(torch.stack([self.codec.out_of_range(w) for q in peers for w in result.updates[q]]).any())
        ):
            raise CodecError("a DeMo payload has the wrong number of tensors or positions outside its chunks")
        out: list[torch.Tensor] = [None] * len(self.params)
        for grp in self.groups:
            want = wires[grp.members[0]].parts["indices"].shape
            got = [[result.updates[q][i] for i in grp.members] for q in peers]
            if any(w.parts["indices"].shape != want or w.parts["values"].shape != want for ws in got for w in ws):
                raise CodecError("a DeMo payload does not match this parameter's chunking")
            # Every peer's coefficients scattered into its own slot, then one sum over the peer
            # dimension: a fixed-order reduction (no scatter-add races), a few kernels per group.
            idx = torch.stack([torch.stack([w.parts["indices"] for w in ws]) for ws in got]).long()
            val = torch.stack([torch.stack([w.parts["values"] for w in ws]) for ws in got]).float()
            dense = torch.zeros(*idx.shape[:-1], grp.cr * grp.cc, device=idx.device)
            total = dense.scatter_(3, idx, val).sum(0)
            signs = group_idct(total / len(peers), grp.shape, grp.cr, grp.cc).sign()
            for g, i in enumerate(grp.members):
                out[i] = signs[g].to(self.params[i].dtype)
        return out
