"""The coordinator's secrets on disk, next to its database: the run CA and the admin credential.

Files (all created on first start; keys and the admin secret are 0600):
    <db>.ca.key     the CA's private key; also the key of the coordinator's TLS certificate
    <db>.ca.crt     the CA certificate; self-signed, and also the coordinator's TLS certificate
    <db>.admin-key  the admin secret that `murmur admin` presents as gRPC metadata

Why the CA certificate doubles as the TLS certificate: a joining node has no certificate and
no CA yet. Its join token carries the CA's fingerprint; the node reads the certificate the
coordinator presents, checks the fingerprint, and trusts it (protocol/jointoken.py). The same
certificate then verifies every node's and every peer's certificate, so there is one root to pin.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from murmur.errors import MurmurError
from murmur.protocol import identity
from murmur.protocol.jointoken import certificate_fingerprint

from .settings import TLS_SERVER_NAME

CA_VALIDITY = dt.timedelta(days=3650)


class CredentialError(MurmurError):
    pass


@dataclass(slots=True)
class Secrets:
    ca: identity.CertificateAuthority
    admin_key: str
    admin_key_path: Path
    ca_cert_path: Path

    @property
    def ca_fingerprint(self) -> str:
        return certificate_fingerprint(self.ca.cert_pem)

    @property
    def tls_key_pem(self) -> bytes:
        return identity.key_to_pem(self.ca.key)


def paths(db_path: Path) -> tuple[Path, Path, Path]:
    return (
        db_path.with_name(db_path.name + ".ca.key"),
        db_path.with_name(db_path.name + ".ca.crt"),
        db_path.with_name(db_path.name + ".admin-key"),
    )


def _make_ca(key: identity.PrivateKey, extra_names: list[str]) -> identity.CertificateAuthority:
    names = [TLS_SERVER_NAME, "localhost", *extra_names, "127.0.0.1"]
    return identity.CertificateAuthority.create("coordinator", validity=CA_VALIDITY, key=key, server_names=names)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_or_create(db_path: Path, host_names: list[str] | None = None) -> Secrets:
    """Load the CA and the admin secret next to ``db_path``, creating whichever is missing."""
    key_path, cert_path, admin_path = paths(db_path)
    if key_path.exists() != cert_path.exists():
        raise CredentialError(
            f"only one of {key_path.name} and {cert_path.name} exists next to {db_path}; restore the "
            "other from a backup (nodes pinned this CA), or move both away to start a new CA"
        )
    if key_path.exists():
        key = identity.key_from_pem(key_path.read_bytes())
        ca = identity.CertificateAuthority(key, cert_path.read_bytes())
    else:
        key = identity.generate_key()
        ca = _make_ca(key, host_names or [])
        _write_private(key_path, identity.key_to_pem(key))
        cert_path.write_bytes(ca.cert_pem)
    if not admin_path.exists():
        _write_private(admin_path, (secrets.token_urlsafe(32) + "\n").encode())
    admin_key = admin_path.read_text().strip()
    if not admin_key:
        raise CredentialError(f"{admin_path} is empty; delete it and restart to make a new admin key")
    return Secrets(ca=ca, admin_key=admin_key, admin_key_path=admin_path, ca_cert_path=cert_path)
