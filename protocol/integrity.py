"""Checksums of the files murmur writes and reads back: one format, one check, for the node and the
coordinator alike (neither imports the other; both import protocol/).

A file that murmur reads back (a node's checkpoint, a stage peer's checkpoint, a state the
coordinator keeps) ends with a trailer that holds the sha256 of every byte before it:

    payload | TRAILER_MAGIC (16 bytes) | sha256 of the payload (32 bytes)

The payload is whatever the file's own format is (murmur's checkpoint layout, torch.save's zip):
readers that know the trailer check it, then read the payload. torch.load reads a zip with the
trailer after it unchanged (a zip is found from its end, and the trailer is shorter than a zip
comment may be), so the payload needs no copy to be read.

The hash runs over the file in chunks (``CHUNK``), so checking a 2 GB checkpoint costs 2 GB of
reads and no memory beyond one chunk. Written while the file is written (`HashingWriter`), it costs
no second pass; a file a library writes to a path is sealed after it (`seal`: one pass over it,
from the page cache).

An export (node/export/write.py) is a folder other tools read too, so its weights file carries no
trailer: its sha256 is in provenance.json (`sha256_file`), and murmur checks it the same way.

Files from before checksums (no trailer): `check` says so (False) and the caller decides; murmur's
readers accept them with one warning line (docs/failure-model.md says why).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

from murmur.errors import MurmurError

TRAILER_MAGIC = b"murmur-sha256-1\n"
DIGEST_BYTES = 32
TRAILER_BYTES = len(TRAILER_MAGIC) + DIGEST_BYTES
CHUNK = 1 << 20  # bytes hashed at a time


class IntegrityError(MurmurError):
    """A file's bytes are not the ones written (corrupt, truncated, overwritten): one line naming
    the file and what to do."""


def sha256_file(path: Path | str, length: int | None = None) -> str:
    """The hex sha256 of the file's first ``length`` bytes (None: all of it), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = length
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while left is None or left > 0:
            n = f.readinto(view if left is None or left >= CHUNK else view[:left])
            if not n:
                break
            h.update(view[:n])
            if left is not None:
                left -= n
    if left:
        raise IntegrityError(f"{path} ends {left:,} bytes early")
    return h.hexdigest()


def trailer(digest: bytes) -> bytes:
    return TRAILER_MAGIC + digest


class HashingWriter:
    """A binary file that hashes what is written through it; `finish` appends the trailer."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.h = hashlib.sha256()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = self.f.write(data)
        if n is None:  # a buffered file writes it all
            n = len(data)
        self.h.update(memoryview(data)[:n])
        return n

    def finish(self) -> None:
        self.f.write(trailer(self.h.digest()))


def seal(path: Path | str) -> str:
    """Append the trailer to a file written whole already (by torch.save, say) and fsync it;
    returns the payload's hex sha256."""
    digest = sha256_file(path)
    with open(path, "ab") as f:
        f.write(trailer(bytes.fromhex(digest)))
        f.flush()
        os.fsync(f.fileno())
    return digest


def has_trailer(path: Path | str) -> bool:
    size = os.path.getsize(path)
    if size < TRAILER_BYTES:
        return False
    with open(path, "rb") as f:
        f.seek(size - TRAILER_BYTES)
        return f.read(len(TRAILER_MAGIC)) == TRAILER_MAGIC


def check(path: Path | str, *, what: str, fix: str, required: bool = False) -> bool:
    """Check the file's trailer against its bytes: True when it matches, False when the file has no
    trailer (written before checksums) and ``required`` is False. IntegrityError, one line naming
    the file, what it is and ``fix`` (what the user should do), when it does not match or when a
    required trailer is missing (the file was cut short)."""
    path = Path(path)
    size = path.stat().st_size
    if not has_trailer(path):
        if required:
            raise IntegrityError(f"{what} {path} is truncated (its checksum trailer is missing): {fix}")
        return False
    with open(path, "rb") as f:
        f.seek(size - DIGEST_BYTES)
        written = f.read(DIGEST_BYTES).hex()
    actual = sha256_file(path, size - TRAILER_BYTES)
    if actual != written:
        raise IntegrityError(
            f"{what} {path} is corrupt (sha256 {actual[:12]}... where {written[:12]}... was written): {fix}"
        )
    return True


def check_digest(path: Path | str, expected: str, *, what: str, fix: str) -> None:
    """Check a whole file against a hex sha256 recorded elsewhere (an export's provenance.json)."""
    actual = sha256_file(path)
    if actual != expected:
        raise IntegrityError(
            f"{what} {path} is corrupt (sha256 {actual[:12]}... where {str(expected)[:12]}... was recorded): {fix}"
        )


def payload_size(path: Path | str) -> int:
    """The file's size without its trailer (its whole size when it has none)."""
    size = os.path.getsize(path)
    return size - TRAILER_BYTES if has_trailer(path) else size


def fsync_dir(folder: Path | str) -> None:
    """Make a rename inside ``folder`` durable (the atomic replace every checked file is written by)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
