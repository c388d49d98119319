"""State transfer: fetch a published state (named tensors) from peers in parallel, verified by hash.

A joiner, or a peer whose round did not complete, fetches what the peers that did complete
published: the global parameters and outer optimizer state of round r (``state/<r>``, published
by the daemon), or one exchange's result (``result/<r>/<key>``, published by the exchange).
The tensors are split among the peers that hold the state and fetched in parallel; a peer that
fails or serves a different hash has its share re-assigned to the others. Nothing is returned
unless the assembled state hashes to what the peers announced (and to ``expected_hash`` if given).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import torch

from murmur.errors import MurmurError
from murmur.node.net.loop import LoopThread
from murmur.protocol import peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BanList, BannedError, Identity
from murmur.protocol.version import PROTOCOL_VERSION, version_metadata
from murmur.protocol.wire import WireError, WireLimits, bytes_to_tensor, tensors_hash


class StateError(MurmurError):
    """No peer could serve the state that was asked for, or it did not match its hash."""


@dataclass(kw_only=True, slots=True)
class StateFetchSettings:
    call_timeout: float = 120.0  # one GetState call, transfer included
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES
    max_state_bytes: int = 64 << 30  # refuse manifests that promise more than this


# A name GetState resolves to the newest ``state/<r>`` the peer serves (the manifest names it): a
# holder that trains alone runs several rounds a second, and drops the state a DHT record of a
# second ago names before a joiner asks for it (test_churn_restart: a restart chased one for 240 s).
NEWEST_STATE = "state/newest"


def state_name(round_id: int) -> str:
    return f"state/{round_id}"


def state_round(name: str) -> int | None:
    """r of a ``state/<r>`` name (None for any other name)."""
    prefix, _, r = name.partition("/")
    return int(r) if prefix == "state" and r.isdigit() else None


def result_name(round_id: int, key: str) -> str:
    return f"result/{round_id}/{key}"


async def get_parts(
    identity: Identity,
    node_id: str,
    address: str,
    name: str,
    tensors: list[str],
    settings: StateFetchSettings,
    ban_list: BanList | None,
) -> tuple[peer_pb2.StateManifest, dict[str, bytes]]:
    """One GetState call to one peer: the manifest of ``name`` and the raw bytes of ``tensors``
    (none: the manifest alone), bounded by ``settings``; StateError for parts not asked for."""
    async with tls.secure_channel(
        identity, address, node_id, ban_list=ban_list, max_message_bytes=settings.max_message_bytes
    ) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        call = stub.GetState(
            peer_pb2.StateRequest(protocol_version=PROTOCOL_VERSION, name=name, tensors=tensors),
            metadata=version_metadata(),
            timeout=settings.call_timeout,
        )
        manifest: peer_pb2.StateManifest | None = None
        data: dict[str, bytearray] = {}
        limit = settings.max_state_bytes
        async for frame in call:
            if frame.WhichOneof("kind") == "manifest":
                manifest = frame.manifest
                continue
            part = frame.part
            if manifest is None or part.name not in tensors:
                raise StateError(f"{node_id} sent {part.name!r} it was not asked for")
            buf = data.setdefault(part.name, bytearray())
            buf += part.data
            limit -= len(part.data)
            if limit < 0:
                raise StateError(f"{node_id} sent more than {settings.max_state_bytes} bytes")
        if manifest is None:
            raise StateError(f"{node_id} sent no manifest for {name!r}")
        return manifest, {k: bytes(v) for k, v in data.items()}


async def newest_state(
    identity: Identity, node_id: str, address: str, settings: StateFetchSettings, ban_list: BanList | None = None
) -> tuple[int, bytes]:
    """(round, hash) of the newest global state the peer serves now (StateError if none)."""
    try:
        manifest, _ = await get_parts(identity, node_id, address, NEWEST_STATE, [], settings, ban_list)
    except (grpc.RpcError, BannedError, OSError) as err:
        raise StateError(f"{node_id}: {_why(err)}") from None
    r = state_round(manifest.name)
    if r is None:
        raise StateError(f"{node_id} answered {NEWEST_STATE!r} with {manifest.name!r}")
    return r, manifest.state_hash


async def afetch(
    identity: Identity,
    peers: Mapping[str, str],
    name: str,
    expected_hash: bytes | None = None,
    *,
    settings: StateFetchSettings | None = None,
    ban_list: BanList | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(name -> tensor in the published order, the members the state names) from ``peers``."""
    settings = settings or StateFetchSettings()
    sources = {n: a for n, a in sorted(peers.items()) if n != identity.node_id}
    errors: dict[str, str] = {}
    if ban_list is not None:
        for n in list(sources):
            if ban_list.is_banned(n):
                errors[n] = "banned"
                del sources[n]
    manifest: peer_pb2.StateManifest | None = None
    # 1. The manifest, from the first peer that serves the expected hash.
    for node_id, address in list(sources.items()):
        try:
            found, _ = await get_parts(identity, node_id, address, name, [], settings, ban_list)
        except (grpc.RpcError, StateError, BannedError, OSError) as err:
            errors[node_id] = _why(err)
            del sources[node_id]
            continue
        if expected_hash is not None and found.state_hash != expected_hash:
            errors[node_id] = f"serves another state (hash {found.state_hash.hex()[:12]})"
            del sources[node_id]
            continue
        manifest = found
        break
    if manifest is None:
        raise StateError(
            f"no peer could serve {name!r}: "
            + ("; ".join(f"{k}: {v}" for k, v in errors.items()) or "none known")
        )
    want_hash = manifest.state_hash
    infos = {t.name: t for t in manifest.tensors}
    total = sum(_nbytes(t) for t in manifest.tensors)
    if total > settings.max_state_bytes:
        raise StateError(
            f"state {name!r} is {total} bytes, more than max_state_bytes {settings.max_state_bytes}"
        )
    # 2. The tensors, split among the sources; a failed source's share goes to the next round.
    todo, got = list(infos), {}
    while todo:
        if not sources:
            raise StateError(f"ran out of peers while fetching {name!r}: {errors}")
        ids = list(sources)
        shares = {n: todo[i :: len(ids)] for i, n in enumerate(ids)}
        results = await asyncio.gather(
            *[get_parts(identity, n, sources[n], name, shares[n], settings, ban_list) for n in ids],
            return_exceptions=True,
        )
        todo = []
        for n, res in zip(ids, results, strict=True):
            if isinstance(res, BaseException) or res[0].state_hash != want_hash:
                errors[n] = _why(res) if isinstance(res, BaseException) else "state changed while fetching"
                todo += shares[n]
                del sources[n]
                continue
            got.update(res[1])
    tensors = {}
    limits = WireLimits(max_numel=settings.max_state_bytes)
    for tname, info in infos.items():
        try:
            tensors[tname] = bytes_to_tensor(got.get(tname, b""), info.dtype, list(info.shape), limits, tname)
        except WireError as err:
            raise StateError(f"state {name!r}: {err}") from None
    if tensors_hash(tensors.items()) != want_hash:
        raise StateError(f"state {name!r} does not match its published hash; refusing it")
    return tensors, list(manifest.members)


def fetch_state(
    peers: Mapping[str, str],
    round_id: int,
    expected_hash: bytes | None,
    *,
    identity: Identity,
    loop: LoopThread | None = None,
    ban_list: BanList | None = None,
    settings: StateFetchSettings | None = None,
) -> dict[str, torch.Tensor]:
    """The global state of round ``round_id`` (as the daemon published it), from ``peers``
    ({node id: address}), verified against ``expected_hash``. Blocking; runs on ``loop`` if given."""
    coro = afetch(identity, peers, state_name(round_id), expected_hash, settings=settings, ban_list=ban_list)
    if loop is not None:
        fut: Future = loop.submit(coro)
        return fut.result()[0]
    return asyncio.run(coro)[0]


def _nbytes(info: peer_pb2.TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= max(int(d), 0)
    return n * 8  # an upper bound on the itemsize


def _why(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__
