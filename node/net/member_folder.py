"""A member's folder: what lets a process rejoin its run as the same node after a restart.

    FOLDER/
      identity/node.key      the node's key pair, made once (the node id derives from it)
      identity/node.crt      the certificate the coordinator issued on join, and its CA (ca.crt)
      join.json              the join reply: run id, node id, addresses, intervals
      run.json               whose state this is: the run id and its coordinator's CA (sha256)
      config.toml            the run configuration the coordinator handed out
      node.lock              held while a process runs on this folder

A token is spent once, on the first join; a process restarted on the folder (after a SIGKILL, a
crash, a reboot) rejoins with the saved record and certificate: the coordinator sees the same node
id, so a driver's lease is still its own and a stage peer's entry is replaced, not doubled.

Every member process keeps its identity this way: the data-parallel node's state folder
(node/daemon/state_dir.py) is a member folder with its training state beside it, and the stage
peer's and the driver's ``--state-dir`` (node/pipeline/) are member folders too. It lives below
both (node/ layers pipeline below daemon) so that neither copies it.

Every write goes to a temporary file first and is renamed into place, so a kill at any instant
leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from murmur.errors import MurmurError
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.coordinator_client import CALL_TIMEOUT_S, JoinInfo, join_run


class MemberFolderError(MurmurError):
    """The folder cannot be used (locked, unwritable, a damaged file)."""


@dataclass(slots=True)
class JoinRecord:
    """What join.json keeps of a join, for a restart to rejoin as the same node: the join reply
    (protocol/coordinator_client.py's JoinInfo) without the run config (config.toml holds it),
    with the coordinator's public address the node joined through."""

    node_id: str
    run_id: str
    coordinator: str  # the public address the node joined through
    node_address: str  # the coordinator's mutual-TLS address for member calls
    tls_server_name: str
    bootstrap_peers: list[str] = field(default_factory=list)
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    lease_ttl_s: float = 30.0

    def join_info(self, config_toml: str) -> JoinInfo:
        """The join reply this record keeps, as a fresh join returns it."""
        return JoinInfo(
            node_id=self.node_id, run_id=self.run_id, config_toml=config_toml, node_address=self.node_address,
            tls_server_name=self.tls_server_name, bootstrap_peers=list(self.bootstrap_peers),
            heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_ttl_s=self.heartbeat_ttl_s,
            lease_ttl_s=self.lease_ttl_s,
        )


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def run_owner(run_id: str, ca_pem: bytes) -> dict[str, str]:
    """Whose state a folder holds: a run of one coordinator (a run id alone may repeat across them)."""
    return {"run_id": run_id, "ca_sha256": hashlib.sha256(ca_pem).hexdigest()}


# The folder locks this process holds. A forked child (hivemind's DHT process) inherits the lock's
# open file, and flock holds until every copy is closed: a node SIGKILLed while its DHT child lives on
# (until protocol/dht_reaper.py kills it, half a second or more under load) would keep its folder
# locked, and its restart would be refused as "another node". So a forked child closes its copies.
# Weak: a lock lives as long as its MemberFolder's file, as before.
_held_locks: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_locks_in_child() -> None:
    for f in list(_held_locks):
        try:
            f.close()
        except OSError:
            pass
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


class MemberFolder:
    error: type[MemberFolderError] = MemberFolderError  # what its refusals raise (the state folder's own)

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self.error(f"cannot create the state folder {self.root}: {err.strerror}") from None
        self._lock_file: Any = None

    # -- exclusive use ---------------------------------------------------------------------------

    def lock(self) -> None:
        """Refuse a second process on the same folder: two nodes with one identity would fight."""
        f = open(self.root / "node.lock", "a+")  # noqa: SIM115 - held for the process's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise self.error(
                f"another murmur node is running on {self.root}; give each node its own --state-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f
        _held_locks.add(f)

    def unlock(self) -> None:
        if self._lock_file is not None:
            _held_locks.discard(self._lock_file)
            self._lock_file.close()
            self._lock_file = None

    # -- identity and join -------------------------------------------------------------------------

    @property
    def identity_dir(self) -> Path:
        return self.root / "identity"

    def node_key(self) -> identity.PrivateKey:
        self.identity_dir.mkdir(exist_ok=True)
        return identity.load_or_create_key(self.identity_dir / "node.key")

    def save_join(self, info: JoinRecord, cert_pem: bytes, ca_pem: bytes, config_toml: str) -> None:
        atomic_write(self.root / "run.json", json.dumps(run_owner(info.run_id, ca_pem)).encode())
        (self.identity_dir / "node.crt").write_bytes(cert_pem)
        (self.identity_dir / "ca.crt").write_bytes(ca_pem)
        atomic_write(self.root / "config.toml", config_toml.encode())
        atomic_write(self.root / "join.json", (json.dumps(asdict(info), indent=1) + "\n").encode())

    def save_join_record(self, info: JoinRecord) -> None:
        """The join record alone (the coordinator handed out new bootstrap peers)."""
        atomic_write(self.root / "join.json", (json.dumps(asdict(info), indent=1) + "\n").encode())

    def load_join(self) -> tuple[JoinRecord, identity.Identity, str] | None:
        """The saved join (info, identity, config text), or None when the node never joined."""
        path = self.root / "join.json"
        if not path.is_file():
            return None
        try:
            info = JoinRecord(**json.loads(path.read_text()))
            ident = identity.Identity.load(self.identity_dir)
            config = (self.root / "config.toml").read_text()
        except (OSError, TypeError, json.JSONDecodeError) as err:
            raise self.error(
                f"{self.root} holds a damaged join record ({err}); remove join.json to join afresh"
            ) from None
        return info, ident, config

    def forget_join(self) -> None:
        """After a clean leave the coordinator wants a fresh join: drop the join record."""
        (self.root / "join.json").unlink(missing_ok=True)

    def set_aside_other_run(self, run_id: str, ca_pem: bytes) -> Path | None:
        """Move what the folder keeps of another run out of the way of a join to ``run_id``; here
        nothing (the identity is the folder's whatever the run). The daemon's state folder moves a
        run's checkpoint and journal (node/daemon/state_dir.py)."""
        return None


def saved_membership(folder: MemberFolder, coordinator: str) -> tuple[JoinRecord, identity.Identity, str] | None:
    """The membership ``folder`` keeps of ``coordinator`` (join record, identity, run config), or
    None: a start with one rejoins (the coordinator knows the node id already) instead of joining
    afresh."""
    saved = folder.load_join()
    return saved if saved is not None and saved[0].coordinator == coordinator else None


async def join_or_rejoin(
    folder: MemberFolder,
    coordinator: str,
    token: str | None,
    log: Callable[[str], None],
    *,
    hardware: Callable[[], pb.Hardware] | None = None,
    timeout_s: float = CALL_TIMEOUT_S,
    name: str = "",
) -> tuple[JoinRecord, identity.Identity, str]:
    """The membership ``folder`` holds for ``coordinator``, else a new one from ``token`` (saved
    there): (join record, identity, the run configuration as TOML). A rejoin spends no token.
    ``hardware``: what the join reports of this machine (asked only for a fresh join)."""
    saved = saved_membership(folder, coordinator)
    if saved is not None:
        info, ident, config = saved
        log(f"rejoining run {info.run_id} as {info.node_id} (identity from {folder.root})")
        return info, ident, config
    if not token:
        raise folder.error(
            f"{folder.root} holds no membership of the coordinator at {coordinator}: "
            "pass --token (from `murmur admin tokens create`)"
        )
    ident, joined = await join_run(
        coordinator, token, folder.node_key(), hardware=hardware() if hardware else None, timeout_s=timeout_s, name=name
    )
    info = JoinRecord(
        node_id=joined.node_id,
        run_id=joined.run_id,
        coordinator=coordinator,
        node_address=joined.node_address,
        tls_server_name=joined.tls_server_name,
        bootstrap_peers=list(joined.bootstrap_peers),
        heartbeat_interval_s=joined.heartbeat_interval_s,
        heartbeat_ttl_s=joined.heartbeat_ttl_s,
        lease_ttl_s=joined.lease_ttl_s,
    )
    if (aside := folder.set_aside_other_run(joined.run_id, ident.ca_cert_pem)) is not None:
        log(f"the local training state belongs to another run (or coordinator): set aside in {aside}, not resumed")
    folder.save_join(info, ident.cert_pem, ident.ca_cert_pem, joined.config_toml)
    log(f"joined run {info.run_id} as {info.node_id}" + (f" ({name})" if name else ""))
    return info, ident, joined.config_toml
