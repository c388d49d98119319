"""Compressors: a tensor in, wire tensors out, and back; with error-feedback state per key.

One small interface (after hivemind's compression/base.py, plus error feedback and exact byte
counts). ``encode(x, key)`` adds the key's error-feedback residual to ``x`` (for codecs that keep
one), encodes, and keeps what the wire lost as the new residual; ``decode(wire)`` is stateless, so
any peer can decode any other peer's payload. ``wire.nbytes`` is the exact payload size.

``dense`` tells the exchange how the codec travels in an all-reduce: a dense codec's aggregate
can be re-encoded by the chunk owner and sent back (bytes of a ring / butterfly all-reduce); a
sparse one (top-k) cannot, so every member receives every payload (an all-gather).

The blockwise integer codecs run on murmur.kernels (Triton on a GPU). Top-k, sign and the DCT of
DeMo are pure torch here: the kernels' versions differ in layout (top-k ordered by magnitude rather
than position; DCT tiles padded to one chunk size rather than divisor tiles), so switching them
would change the wire format; the helpers below define ours.
"""

from __future__ import annotations

import abc
import hashlib
import math

import torch

from murmur import kernels
from murmur.errors import MurmurError
from murmur.optim.wire import WireTensor


class CodecError(MurmurError):
    """An unknown codec name or a payload that does not decode."""


class Codec(abc.ABC):
    name: str = ""
    dense: bool = True
    # Keep the residual of what was not sent and add it to the next payload of the same key.
    error_feedback: bool = False
    # Sparse codecs: average each coordinate over the members that sent it (optim/reduce.py)
    # rather than over all members, counting a coordinate not sent as 0.
    average_over_senders: bool = False

    def __init__(self, *, error_feedback: bool | None = None, ef_decay: float = 1.0) -> None:
        if error_feedback is not None:
            self.error_feedback = error_feedback
        self.ef_decay = ef_decay
        self.residuals: dict[str, torch.Tensor] = {}

    # -- the interface ------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, key: str) -> WireTensor:
        x = x.detach().float()
        if self.error_feedback:
            res = self.residuals.get(key)
            if res is not None:  # (a residual loaded from a checkpoint may sit on the CPU)
                res = res.to(x.device)
                x = x + res * self.ef_decay if self.ef_decay != 1.0 else x + res
        wire = self._encode(x, key)
        wire.shape, wire.dtype = tuple(x.shape), "float32"
        if self.error_feedback:
            self.residuals[key] = x - self.decode(wire).to(x.device)
        return wire

    def encode_stateless(self, x: torch.Tensor, key: str = "") -> WireTensor:
        """Encode without touching error feedback: what a chunk owner sends back after reducing."""
        wire = self._encode(x.detach().float(), key)
        wire.shape, wire.dtype = tuple(x.shape), "float32"
        return wire

    def decode(self, wire: WireTensor) -> torch.Tensor:
        if wire.codec != self.name:
            raise CodecError(f"payload encoded with {wire.codec!r} cannot be decoded by {self.name!r}")
        return self._decode(wire).reshape(wire.shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual/{k}": v for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        prefix = "residual/"
        self.residuals = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}

    # -- per codec ----------------------------------------------------------------------------

    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, key: str) -> WireTensor: ...

    @abc.abstractmethod
    def _decode(self, wire: WireTensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# Plain casts


class CastCodec(Codec):
    def __init__(self, name: str, dtype: torch.dtype, **kw) -> None:
        super().__init__(**kw)
        self.name, self.wire_dtype = name, dtype

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        return WireTensor(self.name, (), "", {"values": x.to(self.wire_dtype).contiguous()})

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        return wire.parts["values"].float()


# ---------------------------------------------------------------------------------------------
# Blockwise absmax integer quantization (int8, int4): one fp32 scale per block of `block` values.


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(-1, block)


class BlockIntCodec(Codec):
    def __init__(self, bits: int, block: int, **kw) -> None:
        super().__init__(**kw)
        if bits not in (4, 8):
            raise CodecError(f"blockwise integer codec supports 4 or 8 bits, not {bits}")
        self.bits, self.block = bits, block
        self.name = f"int{bits}"
        self.qmax = 2 ** (bits - 1) - 1  # symmetric: 127 or 7

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        # murmur.kernels: Triton on a GPU, its torch reference elsewhere (same wire layout:
        # int8 q, or two nibbles q+8 per byte low first; one fp32 absmax/qmax scale per block).
        q, scales, _ = kernels.quantize_blockwise(x.reshape(-1), self.bits, self.block)
        return WireTensor(self.name, (), "", {"q": q, "scales": scales}, {"block": self.block})

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        block, n = int(wire.meta["block"]), math.prod(wire.shape)
        if wire.parts["scales"].numel() != -(-n // block):
            raise CodecError(f"{self.name} payload has {wire.parts['scales'].numel()} scales for {n} values")
        return kernels.dequantize_blockwise(wire.parts["q"], wire.parts["scales"], self.bits, block, (n,))


# ---------------------------------------------------------------------------------------------
# Two bits a value (error feedback): a sign bit and a "large" bit per value; per block of `block`
# values two magnitudes, the means of |x| below and at-or-above the block's median |x| (a 1-D
# two-level Lloyd step, as top-k's 2-bit values: never worse than sending zero). 2 bits a value
# plus 32 bits a block (two bf16): 2.5 bits at block 64, 2.125 at 256. MuLoCo sends its outer
# delta in 2 bits with error feedback; this is the dense codec for it.


def two_level(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of values -> (crumbs: sign * 2 + large, uint8 like ``vals``; levels [rows, 2]: the
    small and large magnitude of each row, bf16)."""
    mag = vals.abs()
    big = mag >= mag.median(dim=1, keepdim=True).values
    n_big = big.sum(1).clamp_min(1)
    n_small = (~big).sum(1).clamp_min(1)
    hi = (mag * big).sum(1) / n_big
    lo = (mag * ~big).sum(1) / n_small
    q = (vals >= 0).to(torch.uint8) * 2 + big.to(torch.uint8)
    return q, torch.stack((lo, hi), dim=1).to(torch.bfloat16)


def from_two_level(q: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Inverse of `two_level` (``q`` long, [rows, n]; ``levels`` [rows, 2])."""
    return levels.float().gather(1, q & 1) * ((q >> 1).float() * 2 - 1)


class TwoBitCodec(Codec):
    name = "2bit"
    error_feedback = True

    def __init__(self, block: int, **kw) -> None:
        super().__init__(**kw)
        self.block = block

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        n = x.numel()
        b = _blocks(x, self.block)
        if n % self.block:  # the last block's padding must not move its median: pad with its own values
            last = n % self.block
            tail = x.reshape(-1)[n - last:]
            b[-1, last:] = tail.repeat(-(-self.block // last))[: self.block - last]
        q, levels = two_level(b)
        return WireTensor(self.name, (), "", {"values": pack_crumbs(q), "scales": levels}, {"block": self.block})

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        levels, block, n = wire.parts["scales"], int(wire.meta["block"]), math.prod(wire.shape)
        if levels.dim() != 2 or levels.shape[0] != -(-n // block):
            raise CodecError(f"{self.name} payload has {levels.shape[0]} blocks' levels for {n} values")
        q = unpack_crumbs(wire.parts["values"], levels.shape[0] * block).view(-1, block).long()
        return from_two_level(q, levels).reshape(-1)[:n]


# ---------------------------------------------------------------------------------------------
# Chunked top-k (error feedback): the k largest |values| of every chunk, int16 positions.

TOPK_CHUNK = 4096  # elements per chunk; positions within a chunk fit int16


def topk_chunked(x: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = _blocks(x, chunk)
    k = min(k, chunk)
    idx = b.abs().topk(k, dim=1, sorted=False).indices
    idx, _ = idx.sort(dim=1)  # sorted positions: the payload does not depend on topk's tie order
    return idx, b.gather(1, idx)


def scatter_chunked(idx: torch.Tensor, values: torch.Tensor, chunk: int, numel: int) -> torch.Tensor:
    out = values.new_zeros(idx.shape[0], chunk)
    out.scatter_(1, idx.long(), values)
    return out.reshape(-1)[:numel]


def pack_crumbs(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 3] -> four per byte."""
    u = q.reshape(-1).to(torch.uint8)
    pad = (-u.numel()) % 4
    if pad:
        u = torch.cat((u, u.new_zeros(pad)))
    u = u.view(-1, 4)
    return u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)


def unpack_crumbs(packed: torch.Tensor, n: int) -> torch.Tensor:
    parts = [(packed >> s) & 3 for s in (0, 2, 4, 6)]
    return torch.stack(parts, dim=1).reshape(-1)[:n]


class TopKCodec(Codec):
    """Top-k per chunk. ``value_bits`` 16: fp16 values; 2: sign and one of two magnitudes per chunk."""

    dense = False
    error_feedback = True

    def __init__(
        self, fraction: float, value_bits: int = 16, chunk: int = TOPK_CHUNK, *, over_senders: bool = False, **kw
    ) -> None:
        super().__init__(**kw)
        self.average_over_senders = over_senders
        if value_bits not in (2, 16):
            raise CodecError(f"top-k values travel as 16 or 2 bits, not {value_bits}")
        self.chunk, self.value_bits = chunk, value_bits
        self.k = max(1, round(fraction * chunk))
        self.name = "topk" if value_bits == 16 else "topk2bit"

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        chunk = min(self.chunk, max(1, x.numel()))
        idx, vals = topk_chunked(x, chunk, self.k)
        parts = {"indices": idx.to(torch.int16)}
        if self.value_bits == 16:
            parts["values"] = vals.to(torch.float16)
        else:
            # Sign bit + "large" bit, two magnitudes per chunk (`two_level`).
            q, levels = two_level(vals)
            parts["values"] = pack_crumbs(q)
            parts["scales"] = levels
        return WireTensor(self.name, (), "", parts, {"chunk": chunk})

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        idx, chunk = wire.parts["indices"].long(), int(wire.meta["chunk"])
        if self.value_bits == 16:
            vals = wire.parts["values"].float()
        else:
            q = unpack_crumbs(wire.parts["values"], idx.numel()).view(idx.shape).long()
            vals = from_two_level(q, wire.parts["scales"])  # [chunks, 2]: small, large magnitude
        return scatter_chunked(idx, vals, chunk, math.prod(wire.shape))

    def support(self, wire: WireTensor) -> torch.Tensor:
        """Which coordinates the payload sends (bool, the tensor's shape): a sent value may be 0."""
        idx, chunk = wire.parts["indices"].long(), int(wire.meta["chunk"])
        sent = scatter_chunked(idx, torch.ones(idx.shape, dtype=torch.bool, device=idx.device), chunk,
                               math.prod(wire.shape))
        return sent.reshape(wire.shape)


# ---------------------------------------------------------------------------------------------
# Sign: 1 bit per value and one scale (mean |x|) per block; error feedback makes it unbiased over time.


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    u = bits.reshape(-1).to(torch.uint8)
    pad = (-u.numel()) % 8
    if pad:
        u = torch.cat((u, u.new_zeros(pad)))
    shifts = torch.arange(8, device=u.device, dtype=torch.uint8)
    return (u.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & 1).reshape(-1)[:n]


class SignCodec(Codec):
    name = "sign"
    error_feedback = True

    def __init__(self, block: int, **kw) -> None:
        super().__init__(**kw)
        self.block = block

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        b = _blocks(x, self.block)
        scales = b.abs().mean(dim=1)
        if x.numel() % self.block:  # the padded zeros of the last block do not dilute its scale
            last = x.numel() % self.block
            scales[-1] = b[-1, :last].abs().mean()
        parts = {"signs": pack_bits(b >= 0), "scales": scales}
        return WireTensor(self.name, (), "", parts, {"block": self.block})

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        scales, block = wire.parts["scales"], int(wire.meta["block"])
        signs = unpack_bits(wire.parts["signs"], scales.numel() * block).float() * 2 - 1
        return (signs.view(-1, block) * scales[:, None]).reshape(-1)[: math.prod(wire.shape)]


# ---------------------------------------------------------------------------------------------
# PowerSGD-style low rank: one warm-started power iteration per round, error feedback.


def _as_matrix(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)


class PowerSGDCodec(Codec):
    """Rank-r factors P [m, r], Q [n, r] of each matrix, Q warm-started per key.

    Differs from the original PowerSGD in one way: the factors are computed per worker and the
    reducer averages the decoded products P Q^T, so the codec fits the one-payload interface
    (the original all-reduces P, then Q, in two rounds). Vectors travel as fp32.
    """

    name = "powersgd"
    error_feedback = True

    def __init__(self, rank: int, **kw) -> None:
        super().__init__(**kw)
        self.rank = rank
        self.q_state: dict[str, torch.Tensor] = {}

    def _initial_q(self, key: str, n: int, r: int, device: torch.device) -> torch.Tensor:
        # The same key starts from the same Q everywhere: derived from the key, not global RNG.
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, r, generator=gen).to(device)

    def _encode(self, x: torch.Tensor, key: str) -> WireTensor:
        m = _as_matrix(x)
        r = min(self.rank, *m.shape)
        if x.dim() < 2 or r == min(m.shape):  # low rank would not save anything
            return WireTensor(self.name, (), "", {"values": x.reshape(-1).clone()}, {"rank": 0})
        q = self.q_state.get(key)
        q = q.to(m.device) if q is not None else None
        if q is None or q.shape != (m.shape[1], r):
            q = self._initial_q(key, m.shape[1], r, m.device)
        p = torch.linalg.qr(m @ q).Q
        q = m.T @ p
        self.q_state[key] = q
        return WireTensor(self.name, (), "", {"p": p.contiguous(), "q": q.contiguous()}, {"rank": r})

    def encode_stateless(self, x: torch.Tensor, key: str = "") -> WireTensor:
        # Warm-start from the key's Q but leave it as it was: a reducer's re-encode is not a round.
        saved = self.q_state.get(key)
        try:
            return super().encode_stateless(x, key)
        finally:
            if saved is None:
                self.q_state.pop(key, None)
            else:
                self.q_state[key] = saved

    def _decode(self, wire: WireTensor) -> torch.Tensor:
        if int(wire.meta["rank"]) == 0:
            return wire.parts["values"].float()
        return wire.parts["p"].float() @ wire.parts["q"].float().T

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"q/{k}": v for k, v in self.q_state.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.q_state = {k.removeprefix("q/"): v for k, v in state.items() if k.startswith("q/")}


# ---------------------------------------------------------------------------------------------
# Registry


CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "2bit", "topk", "topk2bit", "sign", "powersgd")
# sync.error_feedback: auto keeps the codec's own default.
ERROR_FEEDBACK = {"auto": None, "on": True, "off": False}


def make_codec(
    name: str,
    *,
    block: int = 64,
    topk_fraction: float = 0.0156,
    powersgd_rank: int = 4,
    error_feedback: bool | None = None,
    ef_decay: float = 1.0,
    sparse_average: str = "members",
) -> Codec:
    """A fresh codec (its own error-feedback state) by name; unknown names list the known ones."""
    kw = {"error_feedback": error_feedback, "ef_decay": ef_decay}
    if sparse_average not in ("members", "senders"):  # a typo must not quietly mean "members"
        raise CodecError(f"sparse_average is 'members' or 'senders', not {sparse_average!r}")
    if name == "fp32":
        return CastCodec("fp32", torch.float32, **kw)
    if name == "fp16":
        return CastCodec("fp16", torch.float16, **kw)
    if name == "bf16":
        return CastCodec("bf16", torch.bfloat16, **kw)
    if name in ("int8", "int4"):
        return BlockIntCodec(int(name[3:]), block, **kw)
    if name in ("topk", "topk2bit"):
        return TopKCodec(topk_fraction, 16 if name == "topk" else 2, over_senders=sparse_average == "senders", **kw)
    if name == "sign":
        return SignCodec(block, **kw)
    if name == "2bit":
        return TwoBitCodec(block, **kw)
    if name == "powersgd":
        return PowerSGDCodec(powersgd_rank, **kw)
    raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}")


def error_feedback_choice(value: str | bool | None) -> bool | None:
    """sync.error_feedback (auto, on, off) as `make_codec` takes it (None: the codec's default)."""
    if value is None or isinstance(value, bool):
        return value
    if value not in ERROR_FEEDBACK:
        raise CodecError(f"error_feedback must be one of {', '.join(ERROR_FEEDBACK)}, got {value!r}")
    return ERROR_FEEDBACK[value]


def codec_from_config(sync) -> Codec:  # sync: protocol.runconfig.SyncSection
    return make_codec(
        sync.codec,
        block=sync.codec_block,
        topk_fraction=sync.topk_fraction,
        powersgd_rank=sync.powersgd_rank,
        error_feedback=error_feedback_choice(getattr(sync, "error_feedback", "auto")),
        ef_decay=getattr(sync, "ef_decay", 1.0),
        sparse_average=getattr(sync, "sparse_average", "members"),
    )

