"""The discovery plane: murmur's only door to hivemind's DHT (nothing else imports hivemind).

* start or join: ``MurmurDHT(run_id, ..., initial_peers=[multiaddr, ...]).start()``;
  ``addresses`` are the multiaddrs others bootstrap from (the coordinator runs one too).
* announce: this node's record (gRPC address, role, stage, throughput, round) under the run's
  peers key, subkey = its node id, with a TTL; re-announce before it runs out, or it expires and
  the node is gone from every lookup. ``withdraw`` says goodbye at once.
* signed: every record is an envelope {payload, certificate, signature}. ``SignedRecordValidator``
  runs inside every DHT process (hivemind's validator hook): it accepts a record only if the
  certificate comes from the run's CA, names the subkey's node id, and signed this key, subkey,
  payload and an expiry no earlier than the record's. Nobody can announce for another node or
  stretch its record's life. Readers check again and drop banned ids.
* rendezvous: peers ready for round r put themselves under the round's key and read it back
  until the expected number arrived or the deadline passed; the sorted ids are the members.
* shutdown: ``shutdown()`` (also at exit) stops the DHT process and its ``p2pd``; a watcher
  process (protocol/dht_reaper.py) kills both if this process dies without cleaning up.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

from murmur.errors import MurmurError
from murmur.protocol import dht_reaper
from murmur.protocol.fork_guard import FORK_GUARD
from murmur.protocol.identity import (
    BanList,
    Identity,
    IdentityError,
    load_certificate,
    sign,
    verify_certificate,
    verify_signature,
)

# hivemind sets torch's tensor-sharing strategy for the whole process when imported, and its
# default ("file_system") starts a torch_shm_manager helper that outlives the DHT. The DHT only
# shares a few small future buffers with its forked child, which file descriptors carry fine.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

try:  # the GPU box has no hivemind: importing this module there must not fail, only starting
    import hivemind
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from hivemind.utils.mpfuture import MPFuture
except ImportError:  # pragma: no cover - exercised only where hivemind is absent
    hivemind = None
    RecordValidatorBase = object  # type: ignore[assignment,misc]


class DHTError(MurmurError):
    """The DHT could not start, join, store or find what was asked; the message says which."""


@dataclass(kw_only=True, slots=True)
class DHTSettings:
    host: str = "127.0.0.1"  # interface the DHT listens on ("0.0.0.0" to be reachable)
    port: int = 0  # 0: any free port; the real one is in ``addresses``
    record_ttl: float = 30.0  # a peer record lives this long unless re-announced
    rendezvous_ttl: float = 120.0  # a round rendezvous entry lives this long
    poll_interval: float = 0.1  # rendezvous: how often the round's key is read back
    start_timeout: float = 60.0  # the DHT process and p2pd must be up within this
    request_timeout: float = 10.0  # one store or get
    reaper_interval: float = 0.5  # the orphan watcher's polling period
    identity_path: str = ""  # a libp2p key file (made if missing): the same peer id on every start
    # hivemind's client mode: this node stores and reads through others and serves no DHT request
    # (a node that nobody can dial; protocol/reachability.py). It needs a bootstrap peer.
    client_mode: bool = False

    def __post_init__(self) -> None:
        for name in ("record_ttl", "rendezvous_ttl", "poll_interval", "start_timeout", "request_timeout"):
            if getattr(self, name) <= 0:
                raise DHTError(f"DHT setting {name} must be positive, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class PeerRecord:
    node_id: str
    address: str  # host:port of the node's gRPC peer server
    role: str = "trainer"
    stage: int = -1  # SWARM stage served, -1 for none
    throughput: float = 0.0  # as the node measures it: samples/s (pipelines), inner steps/s (sync.round_budget)
    round: int = -1  # last completed round
    state_hash: str = ""  # hex hash of the global state after that round
    expires_at: float = 0.0  # DHT time; filled in by announce
    gone: bool = False  # a goodbye: the node left on purpose


def port_of(addresses: list[str]) -> int:
    """The TCP port of the first ``/ip4/HOST/tcp/PORT/...`` multiaddr (0 if none)."""
    for address in addresses:
        parts = address.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts) and parts[parts.index("tcp") + 1].isdigit():
            return int(parts[parts.index("tcp") + 1])
    return 0


def peers_key(run_id: str) -> str:
    return f"murmur/{run_id}/peers"


def round_key(run_id: str, round_id: int, key: str) -> str:
    return f"murmur/{run_id}/round/{round_id}/{key}"


# --- signed envelopes --------------------------------------------------------------------------


def _signed_message(key_id: bytes, subkey_bytes: bytes, payload: bytes) -> bytes:
    return b"murmur-dht-v1|" + key_id + b"|" + subkey_bytes + b"|" + payload


def seal(identity: Identity, key: str, node_id: str, payload: dict) -> bytes:
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    key_id = DHTID.generate(source=key).to_bytes()
    sig = sign(identity.key, _signed_message(key_id, MSGPackSerializer.dumps(node_id), body))
    envelope = {"p": body.decode(), "c": identity.cert_pem.decode(), "s": base64.b64encode(sig).decode()}
    return json.dumps(envelope, separators=(",", ":")).encode()


def open_envelope(
    raw: object, key_id: bytes, subkey_bytes: bytes, ca_cert_pem: bytes, ban_list: BanList | None = None
) -> tuple[str, dict]:
    """(node id, payload) of a valid envelope; IdentityError or ValueError otherwise."""
    if not isinstance(raw, bytes):
        raise ValueError("record value is not an envelope")
    env = json.loads(raw)
    body, cert = env["p"].encode(), load_certificate(env["c"].encode())
    node_id = verify_certificate(cert, ca_cert_pem, ban_list=ban_list)
    if MSGPackSerializer.loads(subkey_bytes) != node_id:
        raise IdentityError(f"record signed by {node_id} is filed under another node's subkey")
    if not verify_signature(cert, _signed_message(key_id, subkey_bytes, body), base64.b64decode(env["s"])):
        raise IdentityError(f"bad signature on a record of {node_id}")
    payload = json.loads(body)
    if not isinstance(payload, dict):
        raise ValueError("record payload is not an object")
    return node_id, payload


class SignedRecordValidator(RecordValidatorBase):  # type: ignore[misc,valid-type]
    """Runs inside every DHT process: only records sealed by a certified node are stored or returned."""

    def __init__(self, ca_cert_pem: bytes) -> None:
        self.ca_cert_pem = ca_cert_pem

    def validate(self, record: DHTRecord) -> bool:
        try:
            _, payload = open_envelope(
                MSGPackSerializer.loads(record.value), record.key, record.subkey, self.ca_cert_pem
            )
            return float(payload.get("expires_at", 0)) + 1.0 >= record.expiration_time
        except Exception:  # noqa: BLE001 - anything unreadable is simply invalid
            return False


# --- the adapter -------------------------------------------------------------------------------


START_ATTEMPTS = 2


READY_POLL_S = 0.1  # how often a start waiting for its process looks whether it was called off
KILLED_JOIN_S = 5.0  # for the kernel to reap a SIGKILLed DHT process (immediate unless the machine stalls)


class DHTStartAborted(DHTError):
    """``abort_start`` called the start off (the node was told to stop while its DHT started)."""


class _StartFailed(DHTError):
    def __init__(self, message: str, was_ready: bool) -> None:
        super().__init__(message)
        self.was_ready = was_ready

# The DHTs this process has started and not shut down (ids of their MurmurDHT handles).
_live: set[int] = set()
_live_lock = threading.Lock()


async def _reconnect(dht: object, node: object, multiaddrs: list[str]) -> int:
    """In the DHT's process (`MurmurDHT.reconnect`): connect, ping (which adds each peer that
    answers to the routing table, and this node to theirs), then find this node's neighbours."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    answered = 0
    for text in multiaddrs:
        try:
            addr = Multiaddr(text)
            peer = PeerID.from_base58(addr["p2p"])
            # Twice: the first ping may go down the connection to the peer's previous process,
            # which p2pd still holds open; its failure closes it, and the second dial is fresh.
            for attempt in range(2):
                await node.p2p._client.connect(peer, [addr.decapsulate(Multiaddr(f"/p2p/{addr['p2p']}"))])
                if await node.protocol.call_ping(peer) is not None:
                    answered += 1
                    break
                if attempt == 0:
                    await asyncio.sleep(0.5)
        except Exception:  # noqa: BLE001, S112 - a peer that cannot be dialed is skipped
            continue
    if answered:
        await node.find_nearest_nodes([node.node_id])
    return answered


def _fork_safely(start: Callable[[], object]) -> object:
    """Run ``start`` (which forks hivemind's DHT process) so that the child never touches objects
    another thread of this process was changing at the fork.

    A fork copies only the calling thread: objects that the other threads (gRPC's, torch's, a
    pytest worker's earlier tests) were mutating at that instant are copied half-changed, and the
    child's garbage collector walks every object it inherited. A DHT child segfaulted that way in
    the collector while it imported hivemind's multiaddr codecs (`make test`, 2026-12-05), right
    after saying it was ready, and the start failed. So (1) the modules the child would import on
    its first request are imported here first, (2) every object alive now is frozen
    (`gc.freeze`: out of the collector's reach, in the child for good; unfrozen here after), and
    (3) no work that takes the fork guard (protocol/fork_guard.py: a node's model build) runs
    meanwhile.
    No collection first: freezing is what keeps the child off those objects, and a full collection
    of a node's heap took 2.5-3.5 s of a restart at load 28 (in a process forked warm it touches
    every page it shares with the fork server)."""
    _preload_child_imports()
    with FORK_GUARD:
        gc.freeze()
        try:
            return start()
        finally:
            gc.unfreeze()


def _kill_unready(dht: object) -> None:
    """Stop a DHT process that is not ready yet, at once. hivemind's shutdown would wait for it to
    be ready (it reads the shutdown request only then): a whole start, seconds on a loaded machine.
    It is frozen first, so it forks nothing more, then killed; its p2pd, if it got that far, gets
    a SIGTERM (it removes its socket), and a SIGKILL after the reaper's grace."""
    pid = getattr(dht, "pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGSTOP)
    helpers = {p: st for p in dht_reaper.descendants(pid) if (st := dht_reaper.start_time(p)) is not None}
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    dht.join(timeout=KILLED_JOIN_S)  # type: ignore[attr-defined]
    dht_reaper.kill_all(helpers)


def _preload_child_imports() -> None:
    """hivemind imports a multiaddr codec's module the first time an address uses it: parse the
    kinds of addresses a DHT child reports (ip4, ip6, tcp, p2p) here, before it is forked."""
    from hivemind.utils.multiaddr import Multiaddr

    peer = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"  # any valid base58 peer id
    for text in (f"/ip4/127.0.0.1/tcp/1/p2p/{peer}", f"/ip6/::1/tcp/1/p2p/{peer}"):
        Multiaddr(text)


def _fresh_future_backend() -> None:
    """Give hivemind's futures fresh cross-process locks when no DHT of this process is running.

    hivemind's MPFuture guards its result pipe with one multiprocessing lock created at import and
    shared by every process forked afterwards: each DHT process this process started. A DHT process
    SIGKILLed while it holds that lock (the reaper kills what does not stop in time) leaves it held
    for good, and every later DHT process of this one would then hang on its first answer. With no
    DHT of ours alive, no future of the old backend is waited on, so resetting it breaks nothing."""
    with _live_lock:
        if not _live:
            MPFuture.reset_backend()


@dataclass(slots=True)
class _Owned:
    dht: object
    reaper: subprocess.Popen | None
    addresses: list[str] = field(default_factory=list)
    targets: dict[int, str] = field(default_factory=dict)


class MurmurDHT:
    """One node's (or the coordinator's) handle on the run's DHT. Blocking methods are thread-safe;
    the ``a*`` variants run them off the event loop."""

    def __init__(
        self,
        run_id: str,
        *,
        ca_cert_pem: bytes,
        identity: Identity | None = None,
        initial_peers: list[str] | tuple[str, ...] = (),
        settings: DHTSettings | None = None,
        ban_list: BanList | None = None,
    ) -> None:
        self.run_id = run_id
        self.ca_cert_pem = ca_cert_pem
        self.identity = identity
        self.initial_peers = list(initial_peers)
        self.settings = settings or DHTSettings()
        self.ban_list = ban_list or BanList()
        self._owned: _Owned | None = None
        self._lock = threading.Lock()
        self._last_record: PeerRecord | None = None
        self._abort = threading.Event()
        self._shared = False  # a signing_as handle: shutdown leaves the DHT to its owner
        # Called (from the starting thread) once the DHT's process is forked, before it is ready:
        # what must not run under the fork may start then (node/daemon/node.py's model build).
        self.on_forked: Callable[[], None] | None = None

    # lifecycle --------------------------------------------------------------------------------

    def start(self) -> MurmurDHT:
        """Start the DHT process and p2pd; learn the addresses others bootstrap from.

        A start whose own process does not answer is shut down and tried once more: a forked DHT
        process can hang for good (one CI run waited 300 s on its first request after it said it
        was ready), and a fresh process costs a second or two. A start that fails while it reaches
        its bootstrap peers is not retried here: the caller knows whether to try other peers."""
        if hivemind is None:
            raise DHTError(
                "hivemind is not installed on this machine: pip install murmur (it is a dependency)"
            )
        errors = []
        for _ in range(START_ATTEMPTS):
            if self._abort.is_set():
                raise DHTStartAborted("the DHT's start was called off")
            try:
                self._start_once()
                return self
            except _StartFailed as err:
                errors.append(str(err))
                if self.initial_peers and not err.was_ready:
                    break
        raise DHTError("; then ".join(errors))

    def _start_once(self) -> None:
        s = self.settings
        _fresh_future_backend()
        was_ready = False
        try:
            dht = _fork_safely(partial(
                hivemind.DHT,
                initial_peers=self.initial_peers or None,
                start=True,
                host_maddrs=[f"/ip4/{s.host}/tcp/{s.port}"],
                record_validators=[SignedRecordValidator(self.ca_cert_pem)],
                await_ready=False,
                client_mode=s.client_mode,
                **({"identity_path": s.identity_path} if s.identity_path else {}),
            ))
            if self.on_forked is not None:
                self.on_forked()
            self._wait_ready(dht, s.start_timeout)
            was_ready = True
            # The addresses do not change while the process lives: ask once, with a deadline.
            found = dht.run_coroutine(
                partial(hivemind.DHT._get_visible_maddrs, latest=False), return_future=True
            ).result(timeout=s.request_timeout)
            addresses = [str(a) for a in found]
        except Exception as err:  # noqa: BLE001 - hivemind raises many types; the user needs one line
            alive = "dht" in locals() and dht.is_alive()
            if "dht" in locals() and self._abort.is_set() and not was_ready:
                _kill_unready(dht)
            elif "dht" in locals():
                dht.shutdown()
            if self._abort.is_set():
                raise DHTStartAborted("the DHT's start was called off") from None
            hint = " (check the bootstrap addresses)" if self.initial_peers else ""
            what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            state = "" if "dht" not in locals() else (" (its process was alive)" if alive else " (its process died)")
            raise _StartFailed(f"could not start the DHT{hint}: {what}{state}", was_ready) from None
        if self._abort.is_set():  # called off while its addresses were asked for: stop it again
            dht.shutdown()
            raise DHTStartAborted("the DHT's start was called off")
        self._owned = _Owned(dht=dht, reaper=None, addresses=addresses)
        with _live_lock:
            _live.add(id(self))
        self._arm_reaper()
        atexit.register(self.shutdown)

    def abort_start(self) -> None:
        """Call off a ``start`` running in another thread: it stops the process it forked and
        raises DHTStartAborted within READY_POLL_S of its wait for that process (a node told to
        stop while its DHT starts exits within its grace, not after a whole start; issue 50)."""
        self._abort.set()

    def _wait_ready(self, dht: object, timeout: float) -> None:
        """hivemind's wait for the forked process to be ready, in slices, so an ``abort_start``
        is seen; its TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                dht.wait_until_ready(timeout=max(0.0, min(READY_POLL_S, deadline - time.monotonic())))  # type: ignore[attr-defined]
                return
            except TimeoutError:
                if self._abort.is_set():
                    raise DHTStartAborted("the DHT's start was called off") from None
                if time.monotonic() >= deadline:
                    raise

    def _arm_reaper(self) -> None:
        owned = self._owned
        assert owned is not None
        pids = [owned.dht.pid, *dht_reaper.descendants(owned.dht.pid)]
        owned.targets = {pid: st for pid in pids if (st := dht_reaper.start_time(pid)) is not None}
        args = [str(os.getpid()), str(self.settings.reaper_interval)]
        args += [f"{pid}:{st}" for pid, st in owned.targets.items()]
        owned.reaper = subprocess.Popen(
            [sys.executable, "-m", "murmur.protocol.dht_reaper", *args],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )

    @property
    def started(self) -> bool:
        return self._owned is not None

    def signing_as(self, identity: Identity) -> MurmurDHT:
        """A handle on this started DHT that announces and meets as ``identity``: several peers of
        one process (benchmarks/scale.py fits 64 peers on 2 cores so) share one DHT process and
        p2pd, each record still signed by its own peer's key, exactly as that peer's own DHT
        would sign it. Its ``shutdown`` leaves the DHT running: this handle's owner stops it."""
        handle = MurmurDHT(self.run_id, ca_cert_pem=self.ca_cert_pem, identity=identity,
                           initial_peers=self.initial_peers, settings=self.settings, ban_list=self.ban_list)
        handle._owned = self._owned
        handle._shared = True
        if handle._owned is None:
            raise DHTError("start this DHT before sharing it")
        return handle

    def shutdown(self) -> None:
        """Stop the DHT process and p2pd; idempotent; never leaves a child behind."""
        with self._lock:
            owned, self._owned = self._owned, None
        if owned is None or self._shared:
            return
        with _live_lock:
            _live.discard(id(self))
        atexit.unregister(self.shutdown)
        try:
            owned.dht.shutdown()
        finally:
            dht_reaper.kill_all(owned.targets)
            if owned.reaper is not None:
                owned.reaper.terminate()
                try:
                    owned.reaper.wait(timeout=dht_reaper.GRACE_SECONDS + 3)
                except subprocess.TimeoutExpired:
                    owned.reaper.kill()
                    owned.reaper.wait()

    def __enter__(self) -> MurmurDHT:
        return self if self.started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _dht(self):
        if self._owned is None:
            raise DHTError("the DHT is not running (call start() first)")
        return self._owned.dht

    @property
    def addresses(self) -> list[str]:
        """Multiaddrs others can bootstrap from (learnt at start)."""
        self._dht()
        return list(self._owned.addresses)

    @property
    def helper_pids(self) -> list[int]:
        """The DHT process and its p2pd (for leak checks)."""
        return list(self._owned.targets) if self._owned else []

    # records ----------------------------------------------------------------------------------

    def _store(self, key: str, payload: dict, ttl: float) -> bool:
        if self.identity is None:
            raise DHTError("this DHT handle has no identity, so it cannot announce")
        node_id = self.identity.node_id
        expires = get_dht_time() + ttl
        payload = {**payload, "expires_at": expires}
        value = seal(self.identity, key, node_id, payload)
        fut = self._dht().store(key, value, expiration_time=expires, subkey=node_id, return_future=True)
        try:
            return bool(fut.result(timeout=self.settings.request_timeout))
        except Exception as err:  # noqa: BLE001
            raise DHTError(f"DHT store of {key} failed: {err}") from None

    def _read(self, key: str) -> dict[str, dict]:
        """node id -> payload of every valid, unexpired, not banned entry under ``key``."""
        fut = self._dht().get(key, latest=True, return_future=True)
        try:
            found = fut.result(timeout=self.settings.request_timeout)
        except Exception as err:  # noqa: BLE001
            raise DHTError(f"DHT lookup of {key} failed: {err}") from None
        if found is None or not isinstance(found.value, dict):
            return {}
        key_id = DHTID.generate(source=key).to_bytes()
        now = get_dht_time()
        out = {}
        for subkey, item in found.value.items():
            if item.expiration_time < now:
                continue
            try:
                node_id, payload = open_envelope(
                    item.value, key_id, MSGPackSerializer.dumps(subkey), self.ca_cert_pem, self.ban_list
                )
            except Exception:  # noqa: BLE001 - forged, banned or unreadable: not a peer
                continue
            out[node_id] = payload
        return out

    def announce(self, record: PeerRecord, ttl: float | None = None) -> bool:
        if self.identity is None or record.node_id != self.identity.node_id:
            raise DHTError("a node can only announce its own record")
        payload = asdict(record)
        payload.pop("expires_at")
        self._last_record = record
        return self._store(peers_key(self.run_id), payload, ttl or self.settings.record_ttl)

    def withdraw(self) -> None:
        """Say goodbye: a 'gone' record outlives the last announcement, so lookups drop us at once."""
        if self._last_record is None or self._owned is None:
            return
        payload = asdict(self._last_record)
        payload.update(gone=True)
        payload.pop("expires_at")
        self._store(peers_key(self.run_id), payload, self.settings.record_ttl + 1.0)

    def peers(self, role: str | None = None, stage: int | None = None) -> list[PeerRecord]:
        records = []
        for node_id, payload in self._read(peers_key(self.run_id)).items():
            try:
                rec = PeerRecord(**{**payload, "node_id": node_id})
            except TypeError:
                continue
            if (
                rec.gone
                or (role is not None and rec.role != role)
                or (stage is not None and rec.stage != stage)
            ):
                continue
            records.append(rec)
        return sorted(records, key=lambda r: r.node_id)

    def rendezvous(
        self,
        round_id: int,
        key: str,
        address: str,
        *,
        deadline: float,
        expected: int | Callable[[], int | None] | None = None,
        min_members: int = 1,
        weight: float = 1.0,
        extra: dict | None = None,
        keep: Callable[[str, dict], bool] | None = None,
        waiting: Callable[[dict[str, str]], None] | None = None,
    ) -> dict[str, str]:
        """Join round ``round_id``'s group and return {node id: address} of its members.

        Returns as soon as ``expected`` members are there (a callable is asked again at every poll,
        e.g. the number of live peer records), otherwise at ``deadline`` (time.monotonic),
        with whoever arrived; fewer than ``min_members`` is a DHTError. ``extra`` goes into this
        peer's entry (e.g. its incarnation); ``keep(node id, entry)`` drops entries that are not
        live members (a dead incarnation's entry outlives it by the rendezvous TTL). ``waiting(members)``
        is called at each poll that found fewer than ``expected``: the caller may learn meanwhile
        that a peer it expects is dead (``expected`` is asked again at the next poll).
        """
        rkey = round_key(self.run_id, round_id, key)
        self._store(rkey, {**(extra or {}), "address": address, "weight": weight}, self.settings.rendezvous_ttl)
        members: dict[str, str] = {}
        while True:
            members = {
                n: str(p.get("address", ""))
                for n, p in self._read(rkey).items()
                if p.get("address") and (keep is None or keep(n, p))
            }
            want = expected() if callable(expected) else expected
            if want is not None and len(members) >= want:
                break
            if time.monotonic() + self.settings.poll_interval >= deadline:
                break
            if waiting is not None:
                waiting(members)
            time.sleep(self.settings.poll_interval)
        if len(members) < min_members:
            raise DHTError(
                f"round {round_id} rendezvous: {len(members)} peer(s) by the deadline, {min_members} needed"
            )
        return dict(sorted(members.items()))

    def round_entries(self, round_id: int, key: str) -> dict[str, str]:
        """{node id: address} of who is at a round's rendezvous now, without joining it (a peer
        that looks for the holders of a result it did not take part in)."""
        found = self._read(round_key(self.run_id, round_id, key))
        return dict(sorted((n, str(p["address"])) for n, p in found.items() if p.get("address")))

    def leave_round(self, round_id: int, key: str) -> None:
        """Take this peer's entry out of a round's rendezvous (its call failed and it re-syncs).

        Without this, a round tried again after a failure meets the entries of the failed try: the
        rendezvous fills at once, nobody waits for the peers still re-syncing, and their inputs come
        in later than the first owners' peer timeout, round after round. A newer entry with no
        address replaces ours (the DHT keeps the newest) until we put a fresh one."""
        self._store(round_key(self.run_id, round_id, key), {"address": "", "left": True}, self.settings.rendezvous_ttl)

    def reconnect(self, multiaddrs: list[str]) -> int:
        """Dial these peers again and take them back into the routing table, then look up this
        node's neighbours through them; how many answered. A bootstrap peer that restarted (the
        coordinator's DHT, same key and address) was dropped from the routing tables of the
        nodes that saw it down, and its new process knows only who bootstrapped from it since:
        a node restarted after it met nobody but the coordinator at the rendezvous, the others
        never met it, and they waited for it at every round (issue 37's third item)."""
        dht = self._dht()
        found = dht.run_coroutine(partial(_reconnect, multiaddrs=list(multiaddrs)), return_future=True)
        return int(found.result(timeout=self.settings.request_timeout))

    # asyncio variants: the DHT calls block on a pipe, so they run in a worker thread ------------

    async def areconnect(self, multiaddrs: list[str]) -> int:
        return await asyncio.to_thread(self.reconnect, multiaddrs)

    async def aannounce(self, record: PeerRecord, ttl: float | None = None) -> bool:
        return await asyncio.to_thread(self.announce, record, ttl)

    async def apeers(self, role: str | None = None, stage: int | None = None) -> list[PeerRecord]:
        return await asyncio.to_thread(self.peers, role, stage)

    async def around_entries(self, round_id: int, key: str) -> dict[str, str]:
        return await asyncio.to_thread(self.round_entries, round_id, key)

    async def aleave_round(self, round_id: int, key: str) -> None:
        await asyncio.to_thread(self.leave_round, round_id, key)

    async def arendezvous(self, round_id: int, key: str, address: str, **kwargs: object) -> dict[str, str]:
        return await asyncio.to_thread(self.rendezvous, round_id, key, address, **kwargs)  # type: ignore[arg-type]
