"""What a round does with the payloads once they are together, shared by every `Exchange`.

The in-process exchange (simulator) and the gRPC exchange (nodes) move payloads differently but
must compute the same result and count the same bytes, so both call these functions.

Byte model (per peer, payload bytes only):
- dense codec in an all-reduce: a butterfly / ring. The peer sends (K-1)/K of its own payload to
  the chunk owners, then sends its own reduced chunk, re-encoded with the same codec, to the K-1
  others: (K-1)/K of the result's payload. It receives as much. With fp32 this is the classic
  ring all-reduce's 2 (K-1)/K * 4N.
- sparse codec (top-k) in an all-reduce, and every all-gather: the peer sends its payload to each
  of the K-1 others and receives theirs.

Averaging sparse payloads: members' top-k sets mostly differ, so the mean over all K members moves
a coordinate that one member sent by 1/K of it. With ``sync.sparse_average = "senders"`` each
coordinate is averaged over the members that sent it instead (SparseLoCo's reference code does
this), with the rule ``mean`` only: a robust rule's per-coordinate result has no such rescaling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.optim.wire import WireTensor


def wire_bytes(wires: Sequence[WireTensor]) -> int:
    return sum(w.nbytes for w in wires)


def allreduce_bytes(dense: bool, members: int, own: int, result: int) -> int:
    """Bytes one peer sends (and, by symmetry, receives) in an all-reduce of ``members`` peers."""
    if members <= 1:
        return 0
    if dense:
        return (members - 1) * own // members + (members - 1) * result // members
    return (members - 1) * own


def gather_bytes(members: int, own: int) -> int:
    return max(0, members - 1) * own


def reduce_payloads(
    codec: Codec,
    aggregator: Aggregator,
    payloads: Mapping[str, Sequence[WireTensor]],
    weights: Mapping[str, float],
    key: str = "",
) -> tuple[list[torch.Tensor], list[str], dict[str, str], list[WireTensor]]:
    """Decode every member's payload (sorted peer order), aggregate, and for a dense codec
    re-encode the aggregate as a chunk owner would send it back.

    Returns (the tensors every member applies, members kept, peer -> reason dropped, the wire
    of the result that travels back: empty for sparse codecs).
    """
    peers = sorted(payloads)
    decoded = [[codec.decode(w) for w in payloads[p]] for p in peers]
    agg, dropped_idx = aggregator(decoded, [float(weights[p]) for p in peers])
    dropped = {peers[i]: why for i, why in dropped_idx.items()}
    members = [p for p in peers if p not in dropped]
    if codec.average_over_senders:
        agg = over_senders(codec, agg, [payloads[p] for p in members], [float(weights[p]) for p in members])
    back: list[WireTensor] = []
    if codec.dense:
        back = [codec.encode_stateless(t, f"{key}/{i}") for i, t in enumerate(agg)]
        agg = [codec.decode(w) for w in back]
    return agg, members, dropped, back


def over_senders(
    codec: Codec, mean: list[torch.Tensor], wires: Sequence[Sequence[WireTensor]], weights: Sequence[float]
) -> list[torch.Tensor]:
    """The weighted mean over all members (a coordinate not sent counting as 0) turned into the
    weighted mean over the members that sent each coordinate: times total weight / senders' weight."""
    total = float(sum(weights))
    out = []
    for i, t in enumerate(mean):
        sent = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        for member, w in zip(wires, weights, strict=True):  # fixed order: sorted peers
            if w > 0:
                sent.add_(codec.support(member[i]).to(t.device), alpha=w)
        out.append(torch.where(sent > 0, t * (total / sent.clamp_min(1e-30)), t))
    return out
