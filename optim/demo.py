"""DeMo, decoupled momentum (Peng et al. 2024): each step, send only the few largest DCT
coefficients of the momentum and keep the rest in it (error feedback); apply the sign of the
mean of everyone's coefficients.

Per parameter, each step:
    m = beta * m + lr * g
    C = DCT-II of m over chunks (c x c tiles for matrices, c-long pieces for vectors)
    keep the k largest |C| of each chunk -> (int16 positions, bf16 values): the wire
    m = m - IDCT(sparse kept C)                       # what was sent leaves the momentum
    all-gather every member's wire; Q = IDCT(mean of the scattered coefficients, sorted peer order)
    p = p * (1 - lr * wd)  (matrices only);  p = p - lr * sign(Q)

The chunk along a dimension is the largest divisor of its size that is <= ``demo_chunk``, so every
tensor tiles exactly (50304 rows -> 48, 384 columns -> 64).
"""

from __future__ import annotations

import math
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


def to_chunks(x: torch.Tensor, cr: int, cc: int) -> torch.Tensor:
    """[R, C] -> [R/cr * C/cc, cr, cc] tiles in row-major tile order."""
    m = x.reshape(1, -1) if x.dim() == 1 else x.reshape(x.shape[0], -1)
    r, c = m.shape
    return m.reshape(r // cr, cr, c // cc, cc).permute(0, 2, 1, 3).reshape(-1, cr, cc)


def from_chunks(t: torch.Tensor, shape: tuple[int, ...], cr: int, cc: int) -> torch.Tensor:
    r, c = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    return t.reshape(r // cr, c // cc, cr, cc).permute(0, 2, 1, 3).reshape(shape)


def dct_chunked(x: torch.Tensor, cr: int, cc: int) -> torch.Tensor:
    tiles = to_chunks(x.float(), cr, cc)
    dr, dc = dct_matrix(cr, x.device), dct_matrix(cc, x.device)
    return (dr @ tiles @ dc.T).reshape(tiles.shape[0], -1)


def idct_chunked(coef: torch.Tensor, shape: tuple[int, ...], cr: int, cc: int) -> torch.Tensor:
    tiles = coef.reshape(-1, cr, cc)
    dr, dc = dct_matrix(cr, coef.device), dct_matrix(cc, coef.device)
    return from_chunks(dr.T @ tiles @ dc, shape, cr, cc)


class DCTTopKCodec(Codec):
    """DeMo's compressor: top-k DCT coefficients per chunk. Error feedback lives in DeMo's momentum."""

    name = "demo_dct"
    dense = False

    def __init__(self, topk: int, chunk: int) -> None:
        super().__init__(error_feedback=False)
        self.topk, self.chunk = topk, chunk

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        cr, cc = chunk_shape(tuple(x.shape), self.chunk)
        coef = dct_chunked(x, cr, cc)
        k = min(self.topk, coef.shape[1])
        idx = coef.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        parts = {"indices": idx.to(torch.int16), "values": coef.gather(1, idx).to(torch.bfloat16)}
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

    def _decode(self, wire: WireTensor, checked: bool = False) -> torch.Tensor:
        cr, cc = int(wire.meta["chunk_rows"]), int(wire.meta["chunk_cols"])
        return idct_chunked(self.coefficients(wire, checked), tuple(wire.shape), cr, cc)

    def decode_own(self, wire: WireTensor) -> torch.Tensor:
        """Decode a payload this codec just encoded: its positions need no check, and skipping
        it spares a device synchronization per tensor (DeMo decodes its own payload every step)."""
        return self._decode(wire, checked=True).reshape(wire.shape)


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
        self.codec = DCTTopKCodec(sync_cfg.demo_topk, sync_cfg.demo_chunk)
        self.momentum = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    @torch.no_grad()
    def optimizer_step(self, step: int, lr: float) -> None:
        wires = []
        for name, p, m in zip(self.names, self.params, self.momentum, strict=True):
            if p.grad is not None:
                m.mul_(self.beta).add_(p.grad.float(), alpha=lr)
            wire = self.codec.encode(m, name)
            m.sub_(self.codec.decode_own(wire))  # error feedback: keep what was not sent
            wires.append(wire)
        result: GatherResult = self._wait(self.exchange.all_gather(wires, round_id=step, key="demo"))
        directions = result.memo.get("demo_sign", lambda: self._mean_directions(result, wires))
        for p, direction in zip(self.params, directions, strict=True):
            if self.weight_decay and p.dim() >= 2:
                p.mul_(1 - lr * self.weight_decay)
            p.add_(direction.to(p.dtype), alpha=-lr)
        self.outer_steps += 1

    def _mean_directions(self, result: GatherResult, wires: list[WireTensor]) -> list[torch.Tensor]:
        """sign(IDCT(mean of every member's coefficients)) per parameter: the step direction."""
        peers = sorted(result.updates)
        # Untrusted positions would crash the scatter: check every payload, one sync for all.
        if any(len(result.updates[peer]) != len(wires) for peer in peers) or (
            wires and bool(torch.stack([self.codec.out_of_range(w) for q in peers for w in result.updates[q]]).any())
        ):
            raise CodecError("a DeMo payload has the wrong number of tensors or positions outside its chunks")
        out = []
        for i, (p, wire) in enumerate(zip(self.params, wires, strict=True)):
            cr, cc = int(wire.meta["chunk_rows"]), int(wire.meta["chunk_cols"])
            got = [result.updates[q][i] for q in peers]  # sorted peers: a fixed order
            if any(w.parts["indices"].shape != wire.parts["indices"].shape for w in got):
                raise CodecError("a DeMo payload does not match this parameter's chunking")
            # Every peer's coefficients scattered into its own row, then one sum over the peer
            # dimension: a fixed-order reduction (no scatter-add races), a few kernels per tensor.
            idx = torch.stack([w.parts["indices"] for w in got]).long()
            val = torch.stack([w.parts["values"] for w in got]).float()
            dense = torch.zeros(len(got), idx.shape[1], cr * cc, device=idx.device)
            total = dense.scatter_(2, idx, val).sum(0)
            out.append(idct_chunked(total / len(peers), tuple(p.shape), cr, cc).sign())
        return out
