"""The node's checkpoint file: its structure pickled small, then every tensor's bytes written raw.

The round finisher writes a checkpoint (~2 GB for the base preset) after every round while the
training thread queues the next window's kernels, and the two share the GIL. torch.save keeps the
GIL for much of its writing, and the training thread's torch calls wait for it
(benchmarks/checkpoint_gil.py measures the rate of small torch calls beside either writer); plain
file writes release the GIL around each system call. So the tensors' bytes go out through
``file.write`` of their memory, and only the structure (dicts, numbers, strings, and a reference in
place of each tensor) goes through torch's pickler.

    MAGIC | structure length (8 bytes, little endian) | structure (torch.save) | tensor bytes | trailer

The trailer is the sha256 of every byte before it (protocol/integrity.py), hashed while the bytes
are written; `load` checks it before it reads anything, so a checkpoint overwritten in place or cut
short is refused in one line instead of trained from. Files of the format before it (MAGIC_V1, no
trailer) and files torch.save wrote (older murmur versions, no MAGIC) are still read, unchecked:
`verify` says so and the node logs a warning line (docs/failure-model.md).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from murmur.node.daemon.tree import map_leaves
from murmur.protocol import integrity

MAGIC = b"murmur-checkpoint-2\n"  # ends with a checksum trailer
MAGIC_V1 = b"murmur-checkpoint-1\n"  # the same layout without it
FIX = "move it aside (or delete it) and start the node again: it takes the run's state from its peers"
ALIGN = 64  # each tensor's bytes start at a multiple of this in the file


@dataclass(frozen=True, slots=True)
class _TensorRef:
    """Where one tensor's bytes are: read back with its dtype and shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the tensor bytes
    nbytes: int


def save(state: Any, path: Path) -> None:
    """Write ``state`` to ``path`` and fsync it (the caller renames it into place)."""
    tensors: list[torch.Tensor] = []
    refs: list[_TensorRef] = []
    tree = _strip(state, tensors, refs)
    head = io.BytesIO()
    torch.save({"tree": tree, "tensors": refs}, head)
    structure = head.getvalue()
    with open(path, "wb", buffering=0) as raw:
        f = integrity.HashingWriter(raw)
        _write_all(f, memoryview(MAGIC + len(structure).to_bytes(8, "little") + structure))
        pos = 0
        for t, ref in zip(tensors, refs, strict=True):
            if ref.offset > pos:
                _write_all(f, memoryview(bytes(ref.offset - pos)))
            _write_all(f, _bytes_of(t))
            pos = ref.offset + ref.nbytes
        f.finish()
        os.fsync(raw.fileno())


def verify(path: Path, what: str = "checkpoint", fix: str = FIX) -> bool:
    """Check the file against its checksum without reading it into memory: True when it matches,
    False for a file of a format without one (older murmur versions). IntegrityError, one line
    naming the file and what to do, when it does not match or is cut short."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head == MAGIC:
        return integrity.check(path, what=what, fix=fix, required=True)
    return integrity.check(path, what=what, fix=fix)  # older formats: no trailer, False


def load(path: Path, *, verified: bool = False) -> Any:
    """What `save` wrote (or what torch.save wrote, for files from before this format), checked
    against its checksum first unless ``verified`` (the caller ran `verify` on it already)."""
    if not verified:
        verify(path)
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
        if head not in (MAGIC, MAGIC_V1):
            return torch.load(path, map_location="cpu", weights_only=False)
        size = int.from_bytes(_read_exact(f, 8), "little")
        head = torch.load(io.BytesIO(_read_exact(f, size)), map_location="cpu", weights_only=False)
        start = f.tell()
        tensors = []
        for ref in head["tensors"]:
            f.seek(start + ref.offset)
            buf = torch.empty(ref.nbytes, dtype=torch.uint8)
            if ref.nbytes and f.readinto(memoryview(buf.numpy())) != ref.nbytes:
                raise EOFError(f"the checkpoint {path} ends inside a tensor")
            tensors.append(buf.view(ref.dtype).reshape(ref.shape))
    return map_leaves(head["tree"], lambda v: tensors[v.index] if isinstance(v, _TensorRef) else v)


def _strip(obj: Any, tensors: list[torch.Tensor], refs: list[_TensorRef]) -> Any:
    """``obj`` with each tensor replaced by a `_TensorRef` (tensors and refs collected in order; a
    tensor reached twice is written once and read back as one tensor)."""
    seen: dict[int, _TensorRef] = {}

    def strip(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) in seen:
            return seen[id(v)]
        t = v.detach().cpu()
        prev = refs[-1] if refs else None
        offset = 0 if prev is None else -(-(prev.offset + prev.nbytes) // ALIGN) * ALIGN
        ref = seen[id(v)] = _TensorRef(len(refs), t.dtype, tuple(t.shape), offset, t.numel() * t.element_size())
        tensors.append(t)
        refs.append(ref)
        return ref

    return map_leaves(obj, strip)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy when it is contiguous."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(f: BinaryIO | integrity.HashingWriter, data: memoryview) -> None:
    while data:
        n = f.write(data)
        data = data[n:]


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError("the checkpoint ends inside its header")
    return data
