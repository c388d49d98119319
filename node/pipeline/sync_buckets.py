"""The parts of a within-stage sync round: a stage's tensors cut into buckets of a bounded size.

Why: a round's copies (the weights' snapshot or the pseudo-gradient, the exchange's flat copy of
it, the result, the chunks in transit) were each the size of the whole stage: about 4 copies of the
stage's weights at a round's peak, measured in one process (two mates of an 82 MiB stage), on top
of the training state. A round now runs its exchange part by part, one after the other, each its
own exchange call under the same round, so those copies are the size of a part. Streaming DiLoCo's
fragments do the same for the same reason. The outer step, the averaging and the rebase are all
element by element, so a round by parts gives what a round of the whole stage gives on the same
inputs (tests/test_pipeline_sync_buckets.py).

A part is a list of pieces, each a range of one tensor's elements in its flat order; a tensor
larger than the part is cut across parts, so no part exceeds the bound, whatever the stage's
largest tensor. The cut depends only on the tensors' sizes and the bound, so every mate of a stage
cuts alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Piece:
    index: int  # which tensor
    lo: int  # its elements [lo, hi), flat
    hi: int


def cut(numels: list[int], most: int) -> list[list[Piece]]:
    """Buckets of at most ``most`` elements over tensors of ``numels`` elements, in order (``most``
    0 or less: one bucket of everything)."""
    total = sum(numels)
    if most <= 0 or total <= most:
        return [[Piece(i, 0, n) for i, n in enumerate(numels)]]
    buckets: list[list[Piece]] = [[]]
    room = most
    for i, n in enumerate(numels):
        lo = 0
        while lo < n:
            if room == 0:
                buckets.append([])
                room = most
            hi = min(n, lo + room)
            buckets[-1].append(Piece(i, lo, hi))
            room -= hi - lo
            lo = hi
    return buckets


def elements_of(bucket_mb: float, element_size: int = 4) -> int:
    """The elements of a bucket of ``bucket_mb`` MiB (fp32 by default); 0: no bound."""
    return int(bucket_mb * MIB) // element_size if bucket_mb > 0 else 0


def views(tensors: list[torch.Tensor], bucket: list[Piece]) -> list[torch.Tensor]:
    """The bucket's pieces of ``tensors`` as flat views (no copy): writing them writes the tensors.
    Detached, so an in-place write under no_grad touches no autograd state."""
    out = []
    for p in bucket:
        t = tensors[p.index].detach()
        flat = t.view(-1)  # a stage's parameters are contiguous; view() refuses otherwise
        out.append(flat if (p.lo, p.hi) == (0, flat.numel()) else flat[p.lo:p.hi])
    return out


def part_key(key: str, i: int, parts: int) -> str:
    """The exchange key of part ``i`` of a round under ``key`` (the key itself for a whole round)."""
    return key if parts == 1 else f"{key}/part{i}"


def is_part_of(name_key: str, key: str) -> bool:
    """Whether an exchange key is ``key`` or one of its parts."""
    return name_key == key or (name_key.startswith(key + "/part") and name_key[len(key) + 5:].isdigit())
