"""Mutual TLS for the mesh's gRPC: the one place credentials are built from the ``--tls-*`` flags
(``kvmesh.runtime.flags.common_flags``).

A service given a CA, a certificate and a key (``--tls-ca/--tls-cert/--tls-key`` or ``KVMESH_TLS_*``)
serves only callers whose certificate the CA signed, and presents its own on every call it makes
(``create_channel``). The server re-reads the three files when they change (checked at each new
connection), so a rotated certificate is served without a restart; a half-written or mismatched set
is refused with a log line and the previous one kept. Outgoing channels read the files when they are
made: a long-lived channel keeps presenting the certificate it started with, which stays valid until
it expires (rotate before that; docs/security.md).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvmesh.runtime.identity import MESH_SERVER_NAME, server_name

log = structlog.get_logger("kvmesh.tls")


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFiles | None:
        """The three files, or None when none is set; ValueError when only some are."""
        values = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
        given = [k for k, v in values.items() if v]
        if not given:
            return None
        if len(given) != len(values):
            missing = sorted(set(values) - set(given))
            raise ValueError(f"mutual TLS needs --tls-ca, --tls-cert and --tls-key; missing {', '.join(missing)}")
        return cls(Path(args.tls_ca), Path(args.tls_cert), Path(args.tls_key))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate, key) PEM; ValueError when the key is not the certificate's."""
        ca, cert, key = self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()
        public = x509.load_pem_x509_certificate(cert).public_key()
        private = serialization.load_pem_private_key(key, password=None)
        if private.public_key() != public:
            raise ValueError(f"{self.key} is not the key of {self.cert}")
        return ca, cert, key

    def stamp(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.stat().st_mtime_ns, p.stat().st_size) for p in (self.ca, self.cert, self.key))


class _Reloading:
    """grpc's certificate fetcher: a new configuration whenever the files changed, else None (keep)."""

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._lock = threading.Lock()  # grpc may call from several handshakes at once
        self._stamp = files.stamp()
        self.initial = self._config(files.read())

    @staticmethod
    def _config(pems: tuple[bytes, bytes, bytes]) -> grpc.ServerCertificateConfiguration:
        ca, cert, key = pems
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                stamp = self._files.stamp()
                if stamp == self._stamp:
                    return None
                config = self._config(self._files.read())
            except (OSError, ValueError) as e:  # mid-rotation: the pair does not match yet, or a file is gone
                log.warning("TLS files changed but cannot be used yet; keeping the previous ones", error=str(e))
                return None
            self._stamp = stamp
            log.info("TLS certificate reloaded", cert=str(self._files.cert))
            return config


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Credentials that require a client certificate signed by the CA, re-read on rotation."""
    fetch = _Reloading(files)
    return grpc.dynamic_ssl_server_credentials(fetch.initial, fetch, require_client_authentication=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel_options(peer: str | None) -> Sequence[tuple[str, str]]:
    """Check the server's certificate for ``peer``'s name (identity.server_name), or for any mesh member."""
    return [("grpc.ssl_target_name_override", MESH_SERVER_NAME if peer is None else server_name(peer))]


_client: TlsFiles | None = None


def use_client_tls(files: TlsFiles | None) -> None:
    """This process's identity on the calls it makes (``create_channel``); None: plaintext.
    One process, one role: the entry point sets it from its flags."""
    global _client
    _client = files


def client_tls() -> TlsFiles | None:
    return _client
