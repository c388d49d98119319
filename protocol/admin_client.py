"""The operator's connection to a coordinator: TLS to its public address, the admin secret as metadata.
Here, not in coordinator/, because node-side commands use it too (`murmur export --coordinator`).

Where the credentials come from (first match wins):
    admin secret:  --admin-key FILE, $MURMUR_ADMIN_KEY (the secret itself), $MURMUR_ADMIN_KEY_FILE
    CA certificate: --ca-cert FILE, $MURMUR_CA_CERT, else the ``.ca.crt`` beside the admin key file
The coordinator writes both next to its database (``<db>.admin-key``, ``<db>.ca.crt``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from murmur.errors import MurmurError
from murmur.protocol import coordinator_pb2_grpc as pb_grpc
from murmur.protocol.coordinator_names import ADMIN_CALL_TIMEOUT_S, ADMIN_METADATA_KEY, TLS_SERVER_NAME
from murmur.protocol.version import version_metadata

DEFAULT_COORDINATOR = "127.0.0.1:7700"
ADMIN_KEY_SUFFIX = ".admin-key"  # coordinator/authority.py writes <db>.admin-key beside <db>.ca.crt
MAX_SECRET_CHARS = 1024  # the coordinator's are 43; far more is some other file


class AdminError(MurmurError):
    pass


@dataclass(slots=True)
class AdminTarget:
    address: str
    admin_key: str
    ca_cert_pem: bytes


def resolve(address: str | None, admin_key_file: str | None, ca_cert_file: str | None) -> AdminTarget:
    address = address or os.environ.get("MURMUR_COORDINATOR") or DEFAULT_COORDINATOR
    key_path = admin_key_file or os.environ.get("MURMUR_ADMIN_KEY_FILE")
    secret = os.environ.get("MURMUR_ADMIN_KEY", "") if not admin_key_file else ""
    if key_path and not secret:
        secret = _read_key_file(key_path)
    if not secret:
        raise AdminError(
            "this command needs the admin credential: pass --admin-key FILE (the <db>.admin-key "
            "the coordinator wrote next to its database) or set MURMUR_ADMIN_KEY_FILE"
        )
    ca_path = ca_cert_file or os.environ.get("MURMUR_CA_CERT")
    beside_key = not ca_path and bool(key_path and key_path.endswith(ADMIN_KEY_SUFFIX))
    if beside_key:
        ca_path = key_path.removesuffix(ADMIN_KEY_SUFFIX) + ".ca.crt"  # type: ignore[union-attr]
    if not ca_path:
        if key_path:  # a key file by another name: its CA certificate cannot be found beside it
            raise AdminError(
                f"--admin-key {key_path} is not named <db>{ADMIN_KEY_SUFFIX}: pass the coordinator's own "
                "<db>.admin-key file (its <db>.ca.crt is found beside it), or add --ca-cert FILE"
            )
        raise AdminError("pass --ca-cert FILE (the <db>.ca.crt the coordinator wrote) to verify the coordinator")
    try:
        ca_pem = Path(ca_path).read_bytes()
    except OSError as err:
        if beside_key:  # the key file is most likely not the coordinator's: say so first
            raise AdminError(
                f"no CA certificate {ca_path} beside the admin key file {key_path} ({err.strerror}): is it the "
                "<db>.admin-key the coordinator wrote next to its database? else pass --ca-cert FILE"
            ) from None
        raise AdminError(f"cannot read the CA certificate {ca_path}: {err.strerror}; pass --ca-cert FILE") from None
    if b"BEGIN CERTIFICATE" not in ca_pem:
        raise AdminError(f"{ca_path} is not a PEM certificate; pass the coordinator's <db>.ca.crt")
    return AdminTarget(address, secret, ca_pem)


def _read_key_file(key_path: str) -> str:
    """The admin secret in ``key_path``: one line of text (the coordinator writes 43 URL-safe
    characters). Another of the coordinator's files (its database, CA key or certificate) is named
    as the wrong file, before any CA certificate is looked for."""
    try:
        raw = Path(key_path).read_bytes()
    except OSError as err:
        raise AdminError(
            f"cannot read the admin key file {key_path}: {err.strerror}; it is the "
            "<db>.admin-key file the coordinator wrote"
        ) from None
    try:
        secret = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        secret = ""
    if not secret or len(secret) > MAX_SECRET_CHARS or any(c.isspace() or not c.isprintable() for c in secret):
        raise AdminError(
            f"{key_path} is not an admin key file (it holds no one-line secret): pass the <db>.admin-key "
            "file the coordinator wrote next to its database"
        )
    return secret


class AdminClient:
    def __init__(self, target: AdminTarget, timeout_s: float = ADMIN_CALL_TIMEOUT_S) -> None:
        self.target = target
        creds = grpc.ssl_channel_credentials(root_certificates=target.ca_cert_pem)
        self.channel = grpc.secure_channel(
            target.address, creds, options=[("grpc.ssl_target_name_override", TLS_SERVER_NAME)]
        )
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.metadata = (*version_metadata(), (ADMIN_METADATA_KEY, target.admin_key))
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata, timeout=self.timeout_s)
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""  # type: ignore[attr-defined]
            if code == grpc.StatusCode.UNAVAILABLE:
                raise AdminError(
                    f"cannot reach the coordinator at {self.target.address} ({details}); is it "
                    "running there? pass --coordinator HOST:PORT"
                ) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise AdminError(
                    f"the coordinator at {self.target.address} did not answer in {self.timeout_s:g} s; try again"
                ) from None
            raise AdminError(details or str(code)) from None
