"""The run's kept states on the coordinator's disk: one file per version, written atomically.

A version is the run's global state of one round (data parallel: one state, ``state/<r>``), or a
complete set of stage states of one version (pipelined: one state per stage, ``stage/<s>/...``),
as the coordinator pulled them from the nodes (coordinator/keeper.py), hash-checked. Files live
in ``<db>.kept/<run id>/`` beside the ledger:

    MAGIC | header length (8 bytes, little-endian) | header (JSON) | every part's bytes | trailer

The header names the run, the round, and each state's name, hash and parts (name, dtype, shape,
bytes). The trailer is murmur's file checksum (the same layout as protocol/integrity.py's: a magic
line and the sha256 of everything before it), and each state's own hash (what the nodes agreed on)
is checked again when the file is read: a kept state is never served or restored unverified.

Written under a hidden name, fsynced, renamed, the folder fsynced: a crash leaves the previous
versions and at most a hidden partial file (removed at the next write). ``versions`` bound the disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from murmur.errors import MurmurError
from murmur.protocol.integrity import TRAILER_BYTES, TRAILER_MAGIC, HashingWriter, fsync_dir, trailer
from murmur.protocol.state_client import RawState, RawTensor, expected_bytes, raw_hash

MAGIC = b"murmur-kept-state-1\n"
MAX_HEADER_BYTES = 64 << 20
SUFFIX = ".state"


class KeptStateError(MurmurError):
    """A kept file that cannot be used (corrupt, truncated, not one): one line naming it."""


@dataclass(slots=True)
class KeptVersion:
    """One kept version: its round and the states it holds (one, or one per stage)."""

    run_id: str
    round: int
    states: list[RawState]
    kind: str = "global"  # "global" (data parallel) | "stages" (pipelined)
    stages: list[int] | None = None  # pipelined: the stage of each state
    kept_at: float = 0.0
    path: Path | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states)

    def state(self, name: str) -> RawState | None:
        return next((s for s in self.states if s.name == name), None)


def folder(db: Path, run_id: str) -> Path:
    return db.with_name(db.name + ".kept") / run_id


def file_name(round_id: int) -> str:
    return f"round-{round_id:012d}{SUFFIX}"


def write(db: Path, version: KeptVersion, keep: int) -> Path:
    """Write ``version`` beside the ledger, then drop all but the newest ``keep`` versions."""
    where = folder(db, version.run_id)
    where.mkdir(parents=True, exist_ok=True)
    header = {
        "run_id": version.run_id,
        "round": version.round,
        "kind": version.kind,
        "stages": version.stages,
        "kept_at": version.kept_at or time.time(),
        "states": [
            {
                "name": s.name,
                "state_hash": s.state_hash.hex(),
                "members": s.members,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": t.shape, "nbytes": len(t.data)} for t in s.tensors
                ],
            }
            for s in version.states
        ],
    }
    head = json.dumps(header).encode()
    final = where / file_name(version.round)
    tmp = where / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        out = HashingWriter(f)  # protocol/integrity.py's trailer, as on every file murmur reads back
        for piece in (MAGIC, struct.pack("<Q", len(head)), head):
            out.write(piece)
        for s in version.states:
            for t in s.tensors:
                out.write(t.data)
        out.finish()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(where)
    prune(db, version.run_id, keep)
    return final


def prune(db: Path, run_id: str, keep: int) -> None:
    """Keep the newest ``keep`` versions (and no leftover partial file of a crashed write)."""
    where = folder(db, run_id)
    for stale in where.glob(".*.tmp"):
        stale.unlink(missing_ok=True)
    for old in listed(db, run_id)[: -max(1, keep)]:
        old.unlink(missing_ok=True)


def listed(db: Path, run_id: str) -> list[Path]:
    """The run's kept files, oldest first (their names sort by round)."""
    where = folder(db, run_id)
    return sorted(where.glob(f"round-*{SUFFIX}")) if where.is_dir() else []


def disk_bytes(db: Path, run_id: str) -> int:
    return sum(p.stat().st_size for p in listed(db, run_id))


def read(path: Path) -> KeptVersion:
    """A kept file, checked: its checksum trailer, then every state against its own hash."""
    fix = "move it away; the coordinator keeps the next version it pulls, and older ones stay usable"
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 8 + TRAILER_BYTES or not data.startswith(MAGIC):
        raise KeptStateError(f"kept state {path} is not one (or is truncated): {fix}")
    body, trail = data[:-TRAILER_BYTES], data[-TRAILER_BYTES:]
    if not trail.startswith(TRAILER_MAGIC):
        raise KeptStateError(f"kept state {path} is truncated (its checksum trailer is missing): {fix}")
    if trailer(hashlib.sha256(body).digest()) != trail:
        raise KeptStateError(f"kept state {path} is corrupt (its sha256 does not match): {fix}")
    (n,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    if n > MAX_HEADER_BYTES or start + n > len(body):
        raise KeptStateError(f"kept state {path} has a header of {n} bytes: {fix}")
    header = json.loads(body[start : start + n])
    offset = start + n
    states = []
    for s in header["states"]:
        tensors = []
        for t in s["tensors"]:
            size = expected_bytes(t["dtype"], t["shape"])
            if size != t["nbytes"] or offset + size > len(body):
                raise KeptStateError(f"kept state {path}: part {t['name']!r} does not fit its shape: {fix}")
            tensors.append(RawTensor(t["name"], t["dtype"], list(t["shape"]), body[offset : offset + size]))
            offset += size
        state = RawState(s["name"], bytes.fromhex(s["state_hash"]), tensors, list(s.get("members", [])))
        if raw_hash(tensors) != state.state_hash:
            raise KeptStateError(f"kept state {path}: {s['name']} does not match its state hash: {fix}")
        states.append(state)
    return KeptVersion(
        run_id=header["run_id"], round=int(header["round"]), states=states, kind=header.get("kind", "global"),
        stages=header.get("stages"), kept_at=float(header.get("kept_at", 0.0)), path=path,
    )


def newest(db: Path, run_id: str, log=None) -> KeptVersion | None:
    """The newest usable kept version of the run; a file that fails its checks is skipped with a
    line (``log``), so an older version is used rather than none."""
    for path in reversed(listed(db, run_id)):
        try:
            return read(path)
        except (KeptStateError, ValueError, KeyError, struct.error) as err:
            if log is not None:
                why = str(err) if isinstance(err, KeptStateError) else f"kept state {path} unreadable ({err})"
                log(f"warning: {why}")
    return None

