"""What crosses the wire: an encoded tensor as named parts, independent of any transport.

A compressor turns a tensor into a `WireTensor`; the exchange moves it (in process for the
simulator, over gRPC between nodes; `protocol/` maps it to the protobuf message one to one).
`nbytes` is the exact number of payload bytes the transport carries for it, which is what every
byte counter in murmur adds up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class WireTensor:
    codec: str                      # compressor name, e.g. "int4", "topk"
    shape: tuple[int, ...]          # shape of the decoded tensor
    dtype: str                      # dtype of the decoded tensor, e.g. "float32"
    parts: dict[str, torch.Tensor]  # named payload tensors ("values", "scales", "indices", ...)
    meta: dict[str, float | int] = field(default_factory=dict)  # small codec parameters (block, k, ...)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())
