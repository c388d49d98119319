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
        try:
            secret = Path(key_path).read_text().strip()
        except OSError as err:
            raise AdminError(
                f"cannot read the admin key file {key_path}: {err.strerror}; it is the "
                "<db>.admin-key file the coordinator wrote"
            ) from None
    if not secret:
        raise AdminError(
            "this command needs the admin credential: pass --admin-key FILE (the <db>.admin-key "
            "the coordinator wrote next to its database) or set MURMUR_ADMIN_KEY_FILE"
        )
    ca_path = ca_cert_file or os.environ.get("MURMUR_CA_CERT")
    if not ca_path and key_path and key_path.endswith(".admin-key"):
        ca_path = key_path.removesuffix(".admin-key") + ".ca.crt"
    if not ca_path:
        raise AdminError("pass --ca-cert FILE (the <db>.ca.crt the coordinator wrote) to verify the coordinator")
    try:
        ca_pem = Path(ca_path).read_bytes()
    except OSError as err:
        raise AdminError(f"cannot read the CA certificate {ca_path}: {err.strerror}; pass --ca-cert FILE") from None
    if b"BEGIN CERTIFICATE" not in ca_pem:
        raise AdminError(f"{ca_path} is not a PEM certificate; pass the coordinator's <db>.ca.crt")
    return AdminTarget(address, secret, ca_pem)


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
