"""The mesh's own certificate authority: a CA and one certificate per role, written as PEM files.

``kvmesh up``, compose's ``certs`` service and ``kvmesh certs`` make them on first start, so the default
mesh runs with mutual TLS; Helm uses cert-manager or its own CA Secret instead (deploy/helm). A role's
certificate names it twice, as the CN and as the URI SAN ``spiffe://kvmesh/<role>`` (what
``kvmesh.runtime.authz`` reads), and carries the DNS name every mesh client verifies (``tls.MESH_SERVER_NAME``).

Layout of the folder: ``ca.pem`` and ``ca.key`` (the authority), ``<role>.pem`` and ``<role>.key``,
``redis-password`` (what clients send) and ``redis-users.acl`` (Redis's ``--aclfile``: its SHA-256 only, so
the Redis container may read it). Every file is written whole and renamed into place, so a server that reloads a
rotated certificate never reads half of one; a lock makes concurrent first starts agree on one CA.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import ipaddress
import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.runtime.identity import MESH_SERVER_NAME, ROLES, server_name, spiffe_id
from kvmesh.runtime.tls import TlsFiles

CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=30)  # a start this close to a role certificate's end renews it
REDIS_PASSWORD_FILE = "redis-password"
REDIS_ACL_FILE = "redis-users.acl"


def ca_paths(folder: Path) -> tuple[Path, Path]:
    return folder / "ca.pem", folder / "ca.key"


def role_paths(folder: Path, role: str) -> tuple[Path, Path]:
    """(certificate, key) of ``role`` in ``folder``."""
    return folder / f"{role}.pem", folder / f"{role}.key"


def role_identity(folder: Path, role: str) -> TlsFiles:
    """What a process of ``role`` presents and trusts, from the mesh's folder."""
    return TlsFiles(ca_paths(folder)[0], *role_paths(folder, role))


def ensure_mesh_certs(folder: Path, roles: Iterable[str] = ROLES, *, hosts: Iterable[str] = ()) -> Path:
    """A CA in ``folder`` (made unless there) and a certificate for each of ``roles`` that has no current one
    (none, another CA's, one expiring within RENEW_BEFORE, or one without the names this version checks),
    plus the Redis password; returns ``folder``. ``hosts``: more DNS names or IPs every certificate is valid for
    (a public name of the gateway)."""
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        ca_cert, ca_key = _load_or_make_ca(folder)
        for role in roles:
            if not _current(folder, role, ca_cert):
                _write_role(folder, role, ca_cert, ca_key, hosts)
        password = folder / REDIS_PASSWORD_FILE
        if not password.exists():
            _write(password, secrets.token_urlsafe(24).encode(), private=True)
        digest = hashlib.sha256(password.read_bytes()).hexdigest()
        _write(folder / REDIS_ACL_FILE, f"user default on #{digest} ~* &* +@all\n".encode())
    return folder


def renew(folder: Path, role: str, *, hosts: Iterable[str] = (), days: int = LEAF_DAYS) -> None:
    """Issue ``role`` a new key and certificate from the CA in ``folder`` (a rotation)."""
    with _locked(folder):
        ca_cert, ca_key = _load_or_make_ca(folder)
        _write_role(folder, role, ca_cert, ca_key, hosts, days=days)


def self_signed(role: str) -> tuple[bytes, bytes]:
    """(certificate, key) PEM naming ``role``, signed by its own key: what an outsider can make (tests)."""
    key = _new_key()
    name = _name(role)
    cert = _builder(name, name, key, LEAF_DAYS).add_extension(_san(role, ()), critical=False).sign(key, hashes.SHA256())
    return _pem(cert), _key_pem(key)


def _current(folder: Path, role: str, ca_cert: x509.Certificate) -> bool:
    cert_path, key_path = role_paths(folder, role)
    if not (cert_path.exists() and key_path.exists()):
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        cert.verify_directly_issued_by(ca_cert)  # every kvmesh CA has the same name: check the signature
    except (ValueError, TypeError, InvalidSignature):
        return False
    return cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > RENEW_BEFORE and server_name(
        role
    ) in names.get_values_for_type(x509.DNSName)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _load_or_make_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_paths(folder)
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey), f"{key_path}: not the EC key kvmesh makes"
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = _new_key()
    name = _name("kvmesh mesh CA")
    cert = (
        _builder(name, name, key, CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, _pem(cert))
    return cert, key


def _write_role(
    folder: Path,
    role: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hosts: Iterable[str],
    *,
    days: int = LEAF_DAYS,
) -> None:
    key = _new_key()
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # every service is both
    cert = (
        _builder(_name(role), ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(_san(role, hosts), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = role_paths(folder, role)
    # Key first: a reload between the two renames sees the old certificate with the new key, refuses
    # the pair and keeps serving the old one until the certificate lands too (kvmesh.runtime.tls).
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, _pem(cert))


def _san(role: str, hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_id(role)),
        x509.DNSName(server_name(role)),
        x509.DNSName(MESH_SERVER_NAME),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer whose clock is a little behind
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvmesh"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
