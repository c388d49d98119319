"""Identities: a node's key pair, its node id, certificate requests, the run's CA, the ban list.

Every key is ECDSA P-256: gRPC's TLS stack fails the handshake on Ed25519 certificates, and one key
type for TLS, record signatures and the CA keeps the code small.

* node id: derived from the public key (sha256 of the SubjectPublicKeyInfo, base32), so a node
  cannot choose its id and nobody can claim an id without the matching private key. It is a
  valid DNS label, because peers carry it as the certificate's DNS SAN and verify each other with
  ``grpc.ssl_target_name_override`` set to the id the DHT named.
* CSR: the node proves possession of its key; the CA re-derives the id from the CSR's key and
  refuses a request that claims any other id.
* CA: the coordinator is the run's certificate authority. It signs CSRs and verifies
  certificates (issuer signature, validity window, id bound to key, not banned).
* ban list: ids refused at every handshake and every lookup (see node/net/server.py for where
  the TLS connection checks it).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import secrets
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from murmur.errors import MurmurError

NODE_ID_PREFIX = "n"  # ids start with a letter, so they are also valid host names
NODE_ID_HASH_CHARS = 26  # 130 bits of sha256, base32
CERT_VALIDITY = dt.timedelta(days=30)  # a node certificate; nodes re-join to renew
CA_VALIDITY = dt.timedelta(days=3650)
CLOCK_SKEW = dt.timedelta(minutes=5)  # not_before is back-dated by this much

PrivateKey = ec.EllipticCurvePrivateKey
PublicKey = ec.EllipticCurvePublicKey


class IdentityError(MurmurError):
    """A key, request or certificate that cannot be used; the message says which and why."""


class BannedError(IdentityError):
    """The node id is on the run's ban list."""


# --- keys and node ids -------------------------------------------------------------------------


def generate_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_to_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def key_from_pem(pem: bytes) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as err:
        raise IdentityError(f"unreadable private key: {err}") from None
    _require_p256(key.public_key(), "private key")
    return key  # type: ignore[return-value]


def save_key(key: PrivateKey, path: str | os.PathLike[str]) -> None:
    """Write the key readable by its owner only, atomically (a crash never leaves half a key)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_to_pem(key))
    os.replace(tmp, path)


def load_or_create_key(path: str | os.PathLike[str]) -> PrivateKey:
    path = Path(path)
    if path.exists():
        return key_from_pem(path.read_bytes())
    key = generate_key()
    save_key(key, path)
    return key


def public_key_der(public_key: PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def node_id_from_public_key(public_key: PublicKey) -> str:
    digest = hashlib.sha256(public_key_der(public_key)).digest()
    return NODE_ID_PREFIX + base64.b32encode(digest).decode("ascii").lower()[:NODE_ID_HASH_CHARS]


def node_id_of(key: PrivateKey | PublicKey) -> str:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return node_id_from_public_key(public)


def is_node_id(value: str) -> bool:
    body = value[len(NODE_ID_PREFIX) :]
    return (
        value.startswith(NODE_ID_PREFIX)
        and len(body) == NODE_ID_HASH_CHARS
        and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in body)
    )


def _require_p256(public_key: object, what: str) -> None:
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, ec.SECP256R1
    ):
        raise IdentityError(
            f"{what} must be an ECDSA P-256 key (gRPC TLS needs it), got {type(public_key).__name__}"
        )


# --- signatures (DHT records, handshakes) ------------------------------------------------------


def sign(key: PrivateKey, data: bytes) -> bytes:
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def verify_signature(signer: x509.Certificate | PublicKey, data: bytes, signature: bytes) -> bool:
    public = signer.public_key() if isinstance(signer, x509.Certificate) else signer
    if not isinstance(public, ec.EllipticCurvePublicKey):
        return False
    try:
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


# --- certificate requests and certificates -----------------------------------------------------


def make_csr(key: PrivateKey) -> bytes:
    """A PEM certificate signing request naming this key's node id (CN and DNS SAN)."""
    node_id = node_id_of(key)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def load_certificate(pem: bytes | x509.Certificate) -> x509.Certificate:
    if isinstance(pem, x509.Certificate):
        return pem
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as err:
        raise IdentityError(f"unreadable certificate: {err}") from None


def cert_to_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _dns_names(extensions: x509.Extensions) -> list[str]:
    try:
        san = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.DNSName)


def node_id_of_certificate(cert: bytes | x509.Certificate) -> str:
    """The node id a certificate names (its DNS SAN); not a verification, see verify_certificate."""
    names = [n for n in _dns_names(load_certificate(cert).extensions) if is_node_id(n)]
    if len(names) != 1:
        raise IdentityError(
            f"certificate must name exactly one node id in its DNS SAN, found {names or 'none'}"
        )
    return names[0]


@dataclass(frozen=True, slots=True)
class Identity:
    """What a node holds to talk mutual TLS: its key, its certificate, the run's CA certificate."""

    key: PrivateKey
    cert_pem: bytes
    ca_cert_pem: bytes

    @property
    def node_id(self) -> str:
        return node_id_of(self.key)

    @property
    def key_pem(self) -> bytes:
        return key_to_pem(self.key)

    def save(self, folder: str | os.PathLike[str]) -> None:
        folder = Path(folder)
        save_key(self.key, folder / "node.key")
        (folder / "node.crt").write_bytes(self.cert_pem)
        (folder / "ca.crt").write_bytes(self.ca_cert_pem)

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> Identity:
        folder = Path(folder)
        try:
            key = key_from_pem((folder / "node.key").read_bytes())
            cert, ca = (folder / "node.crt").read_bytes(), (folder / "ca.crt").read_bytes()
        except FileNotFoundError as err:
            raise IdentityError(
                f"identity folder {folder} is incomplete: {err.filename} is missing"
            ) from None
        if node_id_of_certificate(cert) != node_id_of(key):
            raise IdentityError(f"{folder}/node.crt was issued for another key than {folder}/node.key")
        return cls(key=key, cert_pem=cert, ca_cert_pem=ca)


class CertificateAuthority:
    """The run's CA: signs node CSRs, verifies node certificates."""

    def __init__(self, key: PrivateKey, cert: x509.Certificate | bytes) -> None:
        self.key = key
        self.cert = load_certificate(cert)
        if public_key_der(self.cert.public_key()) != public_key_der(key.public_key()):  # type: ignore[arg-type]
            raise IdentityError("CA certificate does not belong to the CA key")

    @classmethod
    def create(
        cls,
        run_name: str = "murmur",
        *,
        validity: dt.timedelta = CA_VALIDITY,
        key: PrivateKey | None = None,
        server_names: Sequence[str] = (),
    ) -> CertificateAuthority:
        """A new self-signed CA. With ``server_names`` (DNS names or IP addresses) the CA certificate
        also serves as its holder's TLS certificate: the coordinator presents it, so joiners pin one root."""
        key = key or generate_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"murmur CA {run_name}")])
        now = _now()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        )
        if server_names:
            sans: list[x509.GeneralName] = []
            for host in server_names:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    sans.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False).add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        return cls(key, builder.sign(key, hashes.SHA256()))

    @property
    def cert_pem(self) -> bytes:
        return cert_to_pem(self.cert)

    def save(self, folder: str | os.PathLike[str]) -> None:
        folder = Path(folder)
        save_key(self.key, folder / "ca.key")
        (folder / "ca.crt").write_bytes(self.cert_pem)

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> CertificateAuthority:
        folder = Path(folder)
        try:
            return cls(key_from_pem((folder / "ca.key").read_bytes()), (folder / "ca.crt").read_bytes())
        except FileNotFoundError as err:
            raise IdentityError(f"CA folder {folder} is incomplete: {err.filename} is missing") from None

    def sign_csr(
        self, csr_pem: bytes, *, validity: dt.timedelta = CERT_VALIDITY, ban_list: BanList | None = None
    ) -> bytes:
        """Check a CSR and issue a certificate (PEM) for the node id its key derives."""
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except (ValueError, TypeError) as err:
            raise IdentityError(f"unreadable certificate request: {err}") from None
        if not csr.is_signature_valid:
            raise IdentityError(
                "certificate request signature is invalid (the requester does not hold the key)"
            )
        public = csr.public_key()
        _require_p256(public, "the requested key")
        node_id = node_id_from_public_key(public)  # type: ignore[arg-type]
        claimed = {a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
        claimed.update(_dns_names(csr.extensions))
        if claimed - {node_id}:
            raise IdentityError(
                f"certificate request claims {sorted(claimed - {node_id})} but its key is node {node_id}"
            )
        if ban_list is not None:
            ban_list.check(node_id)
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .issuer_name(self.cert.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(min(now + validity, self.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        return cert_to_pem(cert)

    def issue(self, key: PrivateKey | None = None, **kwargs: object) -> Identity:
        """Make (or take) a key and certify it: the local testnet's and the tests' shortcut."""
        key = key or generate_key()
        cert = self.sign_csr(make_csr(key), **kwargs)  # type: ignore[arg-type]
        return Identity(key=key, cert_pem=cert, ca_cert_pem=self.cert_pem)

    def verify(self, cert: bytes | x509.Certificate, *, ban_list: BanList | None = None) -> str:
        return verify_certificate(cert, self.cert, ban_list=ban_list)


def verify_certificate(
    cert: bytes | x509.Certificate,
    ca_cert: bytes | x509.Certificate,
    *,
    ban_list: BanList | None = None,
    now: dt.datetime | None = None,
) -> str:
    """Return the node id of ``cert`` if the run's CA issued it, it is valid now and not banned."""
    cert, ca = load_certificate(cert), load_certificate(ca_cert)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise IdentityError("certificate was not issued by this run's CA") from None
    now = now or _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise IdentityError(
            f"certificate is not valid now (valid {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC); re-join the run to renew it"
        )
    node_id = node_id_of_certificate(cert)
    if node_id != node_id_from_public_key(cert.public_key()):  # type: ignore[arg-type]
        raise IdentityError(f"certificate names {node_id} but carries another node's key")
    if ban_list is not None:
        ban_list.check(node_id)
    return node_id


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# --- ban list ----------------------------------------------------------------------------------


class BanList:
    """Node ids refused everywhere, with the reason. Thread-safe (the gRPC loop and the trainer read it).

    The coordinator owns the authoritative list and hands it to nodes; ``replace`` swaps in a new
    copy atomically. ``save``/``load`` keep a local copy as JSON.
    """

    def __init__(self, entries: dict[str, str] | Iterable[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, str] = {}
        if entries is not None:
            self.replace(entries)

    def ban(self, node_id: str, reason: str = "banned by the run's admin") -> None:
        with self._lock:
            self._entries[node_id] = reason

    def unban(self, node_id: str) -> bool:
        with self._lock:
            return self._entries.pop(node_id, None) is not None

    def replace(self, entries: dict[str, str] | Iterable[str]) -> None:
        new = (
            dict(entries) if isinstance(entries, dict) else {e: "banned by the run's admin" for e in entries}
        )
        with self._lock:
            self._entries = new

    def is_banned(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._entries

    def reason(self, node_id: str) -> str | None:
        with self._lock:
            return self._entries.get(node_id)

    def check(self, node_id: str) -> None:
        reason = self.reason(node_id)
        if reason is not None:
            raise BannedError(f"node {node_id} is banned from this run: {reason}")

    def entries(self) -> dict[str, str]:
        with self._lock:
            return dict(self._entries)

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, str) and self.is_banned(node_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def to_json(self) -> str:
        return json.dumps(self.entries(), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> BanList:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise IdentityError(f"unreadable ban list: {err}") from None
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in data.items()
        ):
            raise IdentityError("ban list must be a JSON object of node id -> reason")
        return cls(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + f".{secrets.token_hex(4)}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BanList:
        path = Path(path)
        return cls.from_json(path.read_text()) if path.exists() else cls()
