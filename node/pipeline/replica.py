"""A stage peer's replica of the next stage, kept on disk instead of in memory.

Every peer of stage s keeps a copy of stage s+1's weights (the last stage: of stage 0), refreshed
every ``pipeline.replica_every_s`` and served to a peer that refills that stage after all its peers
died (node/pipeline/stage_peer.py). Held in memory it cost a peer the next stage's weights for good,
and its refresh (the fetch's buffers, their bytes, the tensors made of them, the published state)
two to three times that while it ran. Here the copy goes from the wire to a file as it arrives:

- **fetch** (`fetch_to_disk`): one ``GetState`` call to the donor, each frame written to the file
  and hashed as it comes (the manifest's order, the same sha256 as `tensors_hash`); a state whose
  hash differs from its manifest's is refused and its file removed. What it holds in memory is one
  frame (``chunk_bytes`` of the donor's server, 1 MiB by default).
- **serve** (`DiskState`): the ``PublishedState`` fields for `PeerServer`, with the tensors'
  shapes only (meta tensors) and each tensor's bytes read from the file when a call asks for it.
- **load** (`DiskState.load_into`): tensor by tensor into a stage being refilled.

The file is ``<folder>/replica-stage-<s>.bin`` (the state folder's ``replica/`` when the peer has
one, else a temporary folder removed at its stop), with its index (names, dtypes, shapes, offsets)
kept in memory: a restarted peer fetches its replica again, as it did before.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from murmur.node.net.state_transfer import StateError, StateFetchSettings
from murmur.protocol import peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BanList, Identity
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata
from murmur.protocol.wire import DTYPES, WireError, WireLimits, bytes_to_tensor, dtype_name


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class DiskState:
    """A replica in a file, served by `PeerServer` one tensor at a time (``open``/``read``/``close``)."""

    def __init__(self, name: str, path: Path, entries: list[Entry], state_hash: bytes) -> None:
        self.name, self.path, self.entries, self.state_hash, self.members = name, path, entries, state_hash, []
        self._by_name = {e.name: e for e in entries}
        # What the manifest needs (names, dtypes, shapes), without the data.
        self.tensors = [(e.name, torch.empty(e.shape, dtype=DTYPES[e.dtype], device="meta")) for e in entries]

    def open(self) -> DiskState:
        """A call's reader (`PeerServer.GetState`): the state itself, read from its file."""
        if not self.path.is_file():
            raise StateError(f"the replica file of {self.name} is gone")
        return self

    def close(self) -> None:
        pass

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of tensor ``name`` (all of it by default)."""
        e = self._by_name[name]
        end = e.nbytes if end is None else min(end, e.nbytes)
        with open(self.path, "rb") as f:
            f.seek(e.offset + start)
            return f.read(max(0, end - start))

    def tensor(self, name: str) -> torch.Tensor:
        e = self._by_name[name]
        return bytes_to_tensor(self.read(name), e.dtype, list(e.shape), WireLimits(max_numel=1 << 40), name)

    def load_into(self, params: dict[str, torch.Tensor]) -> None:
        """Copy the replica into ``params`` ({name: parameter}, names and shapes already checked)."""
        with torch.no_grad():
            for e in self.entries:
                params[e.name].copy_(self.tensor(e.name))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _header(name: str, dtype: str, shape: list[int]) -> bytes:
    return f"{name}|{dtype}|{list(shape)}|".encode()  # as protocol/wire.py's tensors_hash


async def fetch_to_disk(
    identity: Identity, node_id: str, address: str, name: str, path: Path,
    settings: StateFetchSettings | None = None, ban_list: BanList | None = None,
) -> DiskState:
    """Fetch the state ``name`` from one peer straight into ``path`` (replaced only once the whole
    state is in and hashes to what the peer's manifest says); StateError otherwise."""
    settings = settings or StateFetchSettings()
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        async with tls.secure_channel(identity, address, node_id, ban_list=ban_list,
                                      max_message_bytes=settings.max_message_bytes) as channel:
            stub = peer_pb2_grpc.PeerStub(channel)
            manifest = await _manifest(stub, name, settings)
            entries, state_hash = await _receive(stub, name, manifest, tmp, settings)
    except StateError:
        tmp.unlink(missing_ok=True)
        raise
    except Exception as err:  # noqa: BLE001 - gRPC, TLS, the disk: one answer, the file removed
        tmp.unlink(missing_ok=True)
        raise StateError(f"{node_id}: the replica of {name} could not be fetched: {err}") from None
    tmp.replace(path)
    return DiskState(name, path, entries, state_hash)


async def _manifest(stub, name: str, settings: StateFetchSettings) -> peer_pb2.StateManifest:
    call = stub.GetState(peer_pb2.StateRequest(protocol_version=PROTOCOL_VERSION, name=name, tensors=[]),
                         metadata=version_metadata(), timeout=settings.call_timeout)
    async for frame in call:
        if frame.WhichOneof("kind") == "manifest":
            call.cancel()
            return frame.manifest
    raise StateError(f"no manifest for {name!r}")


async def _receive(stub, name: str, manifest, tmp: Path, settings: StateFetchSettings) -> tuple[list[Entry], bytes]:
    infos = list(manifest.tensors)
    sizes = []
    for t in infos:
        if t.dtype not in DTYPES:
            raise StateError(f"{name}: tensor {t.name} has an unknown dtype {t.dtype!r}")
        n = 1
        for d in t.shape:
            n *= int(d)
        sizes.append(n * torch.empty(0, dtype=DTYPES[t.dtype]).element_size())
    if sum(sizes) > settings.max_state_bytes:
        raise StateError(f"{name} is {sum(sizes)} bytes, more than max_state_bytes {settings.max_state_bytes}")
    entries, offset = [], 0
    for t, size in zip(infos, sizes, strict=True):
        entries.append(Entry(t.name, t.dtype, tuple(int(d) for d in t.shape), offset, size))
        offset += size
    call = stub.GetState(peer_pb2.StateRequest(protocol_version=PROTOCOL_VERSION, name=name,
                                               tensors=[t.name for t in infos]),
                         metadata=version_metadata(), timeout=settings.call_timeout)
    h = hashlib.sha256()
    k, got = -1, 0  # the tensor being received, and its bytes so far
    with open(tmp, "wb") as f:
        async for frame in call:
            if frame.WhichOneof("kind") == "manifest":
                if frame.manifest.state_hash != manifest.state_hash:
                    raise StateError(f"{name} changed between its manifest and its data; asked again next time")
                continue
            part = frame.part
            if k < 0 or part.name != entries[k].name:  # the next tensor begins
                if k >= 0 and got != entries[k].nbytes:
                    raise StateError(f"{name}: tensor {entries[k].name} ended after {got} of {entries[k].nbytes} bytes")
                k, got = k + 1, 0
                while k < len(entries) and entries[k].name != part.name:  # empty tensors may send nothing
                    if entries[k].nbytes:
                        raise StateError(f"{name}: tensor {entries[k].name} never arrived (got {part.name!r})")
                    h.update(_header(entries[k].name, entries[k].dtype, list(entries[k].shape)))
                    k += 1
                if k >= len(entries):
                    raise StateError(f"{name}: unexpected part {part.name!r}")
                h.update(_header(entries[k].name, entries[k].dtype, list(entries[k].shape)))
            if part.dtype != entries[k].dtype or got + len(part.data) > entries[k].nbytes:
                raise StateError(f"{name}: part of {part.name} does not fit its manifest entry")
            f.write(part.data)
            h.update(part.data)
            got += len(part.data)
        for e in entries[k + 1:]:  # empty tensors send no bytes
            if e.nbytes:
                raise StateError(f"{name}: tensor {e.name} never arrived")
            h.update(_header(e.name, e.dtype, list(e.shape)))
        if k >= 0 and got != entries[k].nbytes:
            raise StateError(f"{name}: tensor {entries[k].name} ended after {got} of {entries[k].nbytes} bytes")
        f.flush()
        os.fsync(f.fileno())
    if h.digest() != manifest.state_hash:
        raise StateError(f"{name} does not match its published hash; refusing it")
    return entries, manifest.state_hash


def check_fits(state: DiskState, params: dict[str, torch.Tensor]) -> None:
    """StateError unless the replica holds exactly ``params``' names, shapes and dtypes."""
    if [e.name for e in state.entries] != list(params):
        raise StateError(f"the replica of {state.name} holds other tensors than this stage: another layer split?")
    for e in state.entries:
        p = params[e.name]
        if tuple(p.shape) != e.shape or dtype_name(p.dtype) != e.dtype:
            raise StateError(f"{e.name}: the replica's {list(e.shape)} {e.dtype}, ours {list(p.shape)}")


__all__ = ["DiskState", "Entry", "WireError", "check_fits", "fetch_to_disk"]
