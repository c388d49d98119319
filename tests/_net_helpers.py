"""Shared by the protocol, exchange and DHT tests: a CA, peers on loopback, leak checks."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from murmur.node.exchange.group import StaticGroup
from murmur.node.exchange.grpc_exchange import GrpcExchange
from murmur.node.exchange.peer import PeerSpec, build_peer
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.net.server import PeerServer
from murmur.optim.codecs import make_codec
from murmur.protocol.identity import BanList, CertificateAuthority, Identity

REPO = Path(__file__).resolve().parents[1]
RUN = "test-run"

# Short timeouts: every failure test is bounded by a few of these.
# chunk_mb: 64 elements per pipeline chunk, so the tests' spans travel as several chunks.
FAST = dict(
    peer_timeout=5.0,
    round_deadline=40.0,
    frame_bytes=64 << 10,
    span_align=64,
    chunk_mb=64 * 4 / 1e6,
    catch_up_poll=0.05,
)


@dataclass
class Peer:
    identity: Identity
    server: PeerServer
    exchange: GrpcExchange
    faults: FaultInjector

    @property
    def node_id(self) -> str:
        return self.identity.node_id


def start_peers(
    loop: LoopThread,
    identities: list[Identity],
    codec: str = "fp32",
    ban_lists: list[BanList] | None = None,
    clients: int = 0,
    codec_kw: dict | None = None,
    **settings,
) -> list[Peer]:
    """One exchange peer per identity (node/exchange/peer.py's build_peer), each with its own
    fault injector and its own static group of every peer started here (tests may change a peer's
    view through ``exchange.group.peers``). The last ``clients`` are in client mode, with their
    servers stopped: a peer that dialed one would fail."""
    peers: list[Peer] = []
    try:
        for i, ident in enumerate(identities):
            faults = FaultInjector(stall_seconds=60)
            spec = PeerSpec(
                identity=ident,
                run_id=RUN,
                codec=make_codec(codec, **(codec_kw or {})),
                group=StaticGroup({}),
                settings=ExchangeSettings(**{**FAST, **settings}),
                ban_list=ban_lists[i] if ban_lists is not None else None,
                faults=faults,
                client_mode=i >= len(identities) - clients,
            )
            built = build_peer(spec, loop)
            if built.client_mode:
                loop.run(built.server.stop())
            peers.append(Peer(ident, built.server, built.exchange, faults))
    except BaseException:
        close_peers(loop, peers)
        raise
    view = {p.node_id: p.server.address for p in peers}
    for p in peers:
        p.exchange.group.peers = dict(view)
    return peers


class EntryComesLate:
    """A group whose first look misses one rendezvous entry that every later look shows."""

    def __init__(self, first: dict[str, str], later: dict[str, str]) -> None:
        self.looks = [first]
        self.later = later

    async def members(self, round_id: int, key: str) -> dict[str, str]:
        return dict(self.looks.pop() if self.looks else self.later)


def close_peers(loop: LoopThread, peers: list[Peer]) -> None:
    for p in peers:
        loop.run(p.exchange.aclose())
        loop.run(p.server.stop())


@contextlib.contextmanager
def peer_group(
    n: int, codec: str = "fp32", ca: CertificateAuthority | None = None, clients: int = 0,
    codec_kw: dict | None = None, **settings
) -> Iterator[tuple[LoopThread, list[Peer], CertificateAuthority]]:
    ca = ca or CertificateAuthority.create("test")
    loop = LoopThread()
    peers: list[Peer] = []
    try:
        peers = start_peers(loop, [ca.issue() for _ in range(n)], codec, clients=clients, codec_kw=codec_kw,
                            **settings)
        yield loop, peers, ca
    finally:
        close_peers(loop, peers)
        loop.stop()


class _LostExceptions(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "never retrieved" in record.getMessage():
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)  # autouse in the modules that import it
def no_lost_task_exceptions():
    """Fail a test after which asyncio reports a task or future whose exception nobody retrieved
    (asyncio logs it when the task is collected: "Task exception was never retrieved")."""
    lost, log = _LostExceptions(), logging.getLogger("asyncio")
    log.addHandler(lost)
    try:
        yield
        gc.collect()
    finally:
        log.removeHandler(lost)
    assert not lost.messages, lost.messages


# Other suites run DHTs on this machine at the same time: a p2pd counts as ours only if it
# inherited this tag (children inherit the environment, so orphans keep it too).
LEAK_TAG = f"murmur-net-tests-{os.getpid()}"
os.environ["MURMUR_LEAK_TAG"] = LEAK_TAG


def p2pd_processes() -> list[psutil.Process]:
    """Live p2pd daemons started by this test session (directly or by its child processes)."""
    out = []
    for proc in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["name"] != "p2pd" or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("MURMUR_LEAK_TAG") == LEAK_TAG:
                out.append(proc)
    return out


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable
