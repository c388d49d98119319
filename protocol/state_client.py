"""A published state as raw bytes: the peer protocol's GetState, for a side that holds no torch.

The coordinator keeps the run's newest verified state (coordinator/keeper.py) and never imports
torch, so it cannot use the node's fetch (node/net/state_transfer.py turns every part into a
tensor). This is the same call with the same checks, on bytes: every part's length must match
its declared dtype and shape, the whole must hash to the state hash the holders announce
(``raw_hash`` computes exactly what protocol/wire.py's ``tensors_hash`` does over tensors), and
the coordinator serves what it kept with the same frames (``state_frames``), so a node fetches
it with its ordinary fetch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from murmur.errors import MurmurError
from murmur.protocol import peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BannedError, Identity
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata

# Bytes per element of each dtype that travels on the wire (protocol/wire.py's DTYPES; bool as a byte).
ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}
NEWEST_STATE = "state/newest"  # as node/net/state_transfer.py: the newest state/<r> a holder serves
CHUNK_BYTES = 1 << 20  # frame size of a served state


class RawStateError(MurmurError):
    """No holder served the state asked for, or what arrived does not match its hash."""


@dataclass(slots=True)
class RawTensor:
    name: str
    dtype: str
    shape: list[int]
    data: bytes


@dataclass(slots=True)
class RawState:
    """A state as the peer protocol carries it: named parts in the published order, and its hash."""

    name: str
    state_hash: bytes
    tensors: list[RawTensor]
    members: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(t.data) for t in self.tensors)


def raw_hash(tensors: Iterable[RawTensor]) -> bytes:
    """sha256 over names, dtypes, shapes and bytes in order: protocol/wire.py's ``tensors_hash``."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.data)
    return h.digest()


def expected_bytes(dtype: str, shape: Iterable[int]) -> int:
    if dtype not in ITEMSIZE:
        raise RawStateError(f"dtype {dtype!r} is not one murmur sends")
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims) or len(dims) > 8:
        raise RawStateError(f"shape {dims} is not a tensor's")
    return ITEMSIZE[dtype] * math.prod(dims)


async def fetch_raw(
    identity: Identity,
    holders: Mapping[str, str],
    name: str,
    expected_hash: bytes | None,
    *,
    call_timeout_s: float = 120.0,
    max_bytes: int = 64 << 30,
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES,
) -> RawState:
    """State ``name`` from the first of ``holders`` ({node id: peer address}) that serves it whole
    under ``expected_hash`` (None: under the hash its manifest names, which the bytes must match);
    RawStateError naming every holder's failure otherwise."""
    errors: list[str] = []
    for node_id, address in holders.items():
        try:
            state = await _get_all(identity, node_id, address, name, call_timeout_s, max_bytes, max_message_bytes)
        except (grpc.RpcError, RawStateError, BannedError, OSError) as err:
            errors.append(f"{node_id}: {_why(err)}")
            continue
        if expected_hash is not None and state.state_hash != expected_hash:
            errors.append(f"{node_id}: serves another state (hash {state.state_hash.hex()[:12]})")
            continue
        if raw_hash(state.tensors) != state.state_hash:
            errors.append(f"{node_id}: what it sent does not match the hash it announced")
            continue
        return state
    raise RawStateError(f"no holder served {name!r}: " + ("; ".join(errors) or "none known"))


async def _get_all(
    identity: Identity, node_id: str, address: str, name: str, timeout_s: float, max_bytes: int, max_message: int
) -> RawState:
    """One GetState call for every part of ``name``: the manifest first (a call that asks for no
    part), then the parts it lists."""
    async with tls.secure_channel(identity, address, node_id, max_message_bytes=max_message) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        manifest = None
        async for frame in stub.GetState(
            peer_pb2.StateRequest(protocol_version=PROTOCOL_VERSION, name=name, tensors=[]),
            metadata=version_metadata(), timeout=timeout_s,
        ):
            if frame.WhichOneof("kind") == "manifest":
                manifest = frame.manifest
        if manifest is None:
            raise RawStateError(f"{node_id} sent no manifest for {name!r}")
        sizes = {t.name: expected_bytes(t.dtype, t.shape) for t in manifest.tensors}
        if sum(sizes.values()) > max_bytes:
            raise RawStateError(f"{name!r} is {sum(sizes.values())} bytes, more than the {max_bytes} allowed")
        data: dict[str, bytearray] = {n: bytearray() for n in sizes}
        # The parts of the manifest asked for by name: a holder serves "state/newest" as the state
        # it names, so the second call asks for that name, not for whatever is newest by then.
        async for frame in stub.GetState(
            peer_pb2.StateRequest(protocol_version=PROTOCOL_VERSION, name=manifest.name, tensors=list(sizes)),
            metadata=version_metadata(), timeout=timeout_s,
        ):
            if frame.WhichOneof("kind") == "manifest":
                if frame.manifest.state_hash != manifest.state_hash:
                    raise RawStateError(f"{node_id} moved to another state while it was read")
                continue
            part = frame.part
            buf = data.get(part.name)
            if buf is None:
                raise RawStateError(f"{node_id} sent {part.name!r}, which its manifest does not list")
            buf += part.data
            if len(buf) > sizes[part.name]:
                raise RawStateError(f"{node_id} sent more bytes of {part.name!r} than its shape holds")
    tensors = []
    for t in manifest.tensors:
        got = bytes(data[t.name])
        if len(got) != sizes[t.name]:
            raise RawStateError(f"{node_id} sent {len(got)} bytes of {t.name!r}, its shape holds {sizes[t.name]}")
        tensors.append(RawTensor(t.name, t.dtype, [int(d) for d in t.shape], got))
    return RawState(manifest.name, bytes(manifest.state_hash), tensors, list(manifest.members))


def state_frames(
    state: RawState, wanted: Iterable[str], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[peer_pb2.StateFrame]:
    """What a GetState call for ``wanted`` parts of ``state`` streams: the manifest, then each
    part in frames of at most ``chunk_bytes``."""
    infos = [peer_pb2.TensorInfo(name=t.name, dtype=t.dtype, shape=t.shape) for t in state.tensors]
    yield peer_pb2.StateFrame(
        manifest=peer_pb2.StateManifest(
            name=state.name, state_hash=state.state_hash, tensors=infos, members=state.members
        )
    )
    want = set(wanted)
    for t in state.tensors:
        if t.name not in want:
            continue
        view = memoryview(t.data)
        for start in range(0, max(len(t.data), 1), chunk_bytes):
            piece = bytes(view[start : start + chunk_bytes])
            yield peer_pb2.StateFrame(part={"name": t.name, "dtype": t.dtype, "data": piece})


def _why(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__
