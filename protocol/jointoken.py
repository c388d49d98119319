"""The join token a node presents to the coordinator, and how the node pins the coordinator's CA.

A token reads ``mrm1.<token id>.<secret>.<CA fingerprint>``. The operator gets it from
`murmur admin tokens create` and hands it to the volunteer out of band (chat, mail, a config
file). It is everything a node needs to join safely:

* the token id and secret authenticate the node to the coordinator (only a hash of the secret is
  stored there; the token has an expiry and a use count, and can be revoked);
* the CA fingerprint (sha256 of the DER of the coordinator's CA certificate) authenticates the
  coordinator to the node: the coordinator's TLS certificate *is* its self-signed CA certificate,
  so the node reads it in a plain TLS handshake, checks its fingerprint against the token, and
  only then trusts it as the root for the gRPC channel. No trust on first use, no file to copy.

Shared by the coordinator (which mints tokens) and the node (which parses them), hence protocol/.
"""

from __future__ import annotations

import hashlib
import re
import socket
import ssl
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from murmur.errors import MurmurError

TOKEN_PREFIX = "mrm1"
CA_FETCH_TIMEOUT_S = 10.0  # the plain TLS handshake that reads the coordinator's certificate
_TOKEN_RE = re.compile(r"^mrm1\.([a-z0-9]{8,32})\.([A-Za-z0-9_-]{16,128})\.([0-9a-f]{64})$")


class JoinTokenError(MurmurError):
    pass


@dataclass(frozen=True, slots=True)
class JoinToken:
    token_id: str
    secret: str
    ca_fingerprint: str  # hex sha256 of the CA certificate's DER

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}.{self.token_id}.{self.secret}.{self.ca_fingerprint}"

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        match = _TOKEN_RE.match(text.strip())
        if not match:
            raise JoinTokenError(
                "this is not a murmur join token (expected mrm1.<id>.<secret>.<fingerprint>); "
                "copy the whole token that `murmur admin tokens create` printed"
            )
        return cls(*match.groups())


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def certificate_fingerprint(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def fetch_pinned_ca(address: str, fingerprint: str, *, timeout_s: float = CA_FETCH_TIMEOUT_S) -> bytes:
    """Read the certificate the server at ``host:port`` presents; return its PEM if it is the pinned one.

    The handshake is deliberately unverified: what makes it safe is the fingerprint comparison
    that follows, against the value the token (an out-of-band secret) carries.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise JoinTokenError(f"coordinator address {address!r} must look like host:port")
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])  # gRPC servers expect HTTP/2
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            with ctx.wrap_socket(sock, server_hostname=host) as tls:
                der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as err:
        raise JoinTokenError(f"cannot reach the coordinator at {address}: {err}; is it running?") from None
    if not der or hashlib.sha256(der).hexdigest() != fingerprint:
        raise JoinTokenError(
            f"the server at {address} is not the coordinator this token was made for (certificate "
            "fingerprint differs); check the address, or ask the operator for a fresh token"
        )
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii")
