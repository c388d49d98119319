"""Identities: node ids from keys, CSRs, the run's CA, verification, the ban list."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from murmur.protocol import identity as I  # noqa: N812


@pytest.fixture(scope="module")
def ca():
    return I.CertificateAuthority.create("test-run")


def test_node_id_is_derived_from_the_public_key_and_is_a_dns_label():
    key = I.generate_key()
    nid = I.node_id_of(key)
    assert nid == I.node_id_of(key.public_key()) == I.node_id_from_public_key(key.public_key())
    assert I.is_node_id(nid) and len(nid) <= 63 and nid[0].isalpha()
    assert nid != I.node_id_of(I.generate_key())


def test_ca_signs_a_csr_and_verifies_the_certificate(ca):
    key = I.generate_key()
    cert = ca.sign_csr(I.make_csr(key))
    assert I.node_id_of_certificate(cert) == I.node_id_of(key)
    assert ca.verify(cert) == I.node_id_of(key)
    assert I.verify_certificate(cert, ca.cert_pem) == I.node_id_of(key)


def test_a_csr_claiming_another_nodes_id_is_refused(ca):
    key, victim = I.generate_key(), I.node_id_of(I.generate_key())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, victim)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(victim)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(I.IdentityError, match="claims"):
        ca.sign_csr(csr.public_bytes(I.serialization.Encoding.PEM))


def test_garbage_csr_and_certificate_are_clear_errors(ca):
    with pytest.raises(I.IdentityError, match="unreadable certificate request"):
        ca.sign_csr(b"not a csr")
    with pytest.raises(I.IdentityError, match="unreadable certificate"):
        ca.verify(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")


def test_a_certificate_from_another_ca_is_refused(ca):
    stranger = I.CertificateAuthority.create("other").issue()
    with pytest.raises(I.IdentityError, match="not issued by this run's CA"):
        ca.verify(stranger.cert_pem)


def test_an_expired_certificate_is_refused(ca):
    ident = ca.issue(validity=dt.timedelta(seconds=1))
    later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)
    with pytest.raises(I.IdentityError, match="not valid now"):
        I.verify_certificate(ident.cert_pem, ca.cert_pem, now=later)


def test_banned_nodes_are_refused_by_verify_and_by_the_ca(ca):
    ident = ca.issue()
    bans = I.BanList()
    bans.ban(ident.node_id, "sent poisoned updates")
    with pytest.raises(I.BannedError, match="sent poisoned updates"):
        ca.verify(ident.cert_pem, ban_list=bans)
    with pytest.raises(I.BannedError):
        ca.sign_csr(I.make_csr(ident.key), ban_list=bans)
    assert bans.unban(ident.node_id) and ca.verify(ident.cert_pem, ban_list=bans) == ident.node_id


def test_ban_list_round_trips_and_rejects_bad_files(tmp_path):
    bans = I.BanList({"nabc": "spam"})
    bans.ban("nxyz")
    path = tmp_path / "bans.json"
    bans.save(path)
    loaded = I.BanList.load(path)
    assert loaded.entries() == bans.entries() and "nabc" in loaded and len(loaded) == 2
    path.write_text("[1, 2]")
    with pytest.raises(I.IdentityError, match="JSON object"):
        I.BanList.load(path)
    assert len(I.BanList.load(tmp_path / "missing.json")) == 0


def test_identity_and_ca_save_and_load(tmp_path, ca):
    ident = ca.issue()
    ident.save(tmp_path / "node")
    assert (tmp_path / "node" / "node.key").stat().st_mode & 0o777 == 0o600
    again = I.Identity.load(tmp_path / "node")
    assert again.node_id == ident.node_id and again.cert_pem == ident.cert_pem
    ca.save(tmp_path / "ca")
    assert I.CertificateAuthority.load(tmp_path / "ca").verify(ident.cert_pem) == ident.node_id
    (tmp_path / "node" / "node.crt").write_bytes(ca.issue().cert_pem)
    with pytest.raises(I.IdentityError, match="another key"):
        I.Identity.load(tmp_path / "node")
    with pytest.raises(I.IdentityError, match="incomplete"):
        I.Identity.load(tmp_path / "nowhere")


def test_signatures_verify_only_for_the_signer(ca):
    a, b = ca.issue(), ca.issue()
    sig = I.sign(a.key, b"hello")
    cert = I.load_certificate(a.cert_pem)
    assert I.verify_signature(cert, b"hello", sig)
    assert not I.verify_signature(cert, b"hullo", sig)
    assert not I.verify_signature(I.load_certificate(b.cert_pem), b"hello", sig)
