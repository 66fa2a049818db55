"""Who a peer is in the mesh: its role, read from the certificate it presented in the TLS handshake.

A role's certificate carries the URI SAN ``spiffe://kvmesh/<role>`` (kvmesh.runtime.certs, cert-manager's
certificates in the Helm chart) or, failing that, the role as its CN (the chart's own certificates: Helm
cannot write URI SANs). Only the mesh's CA signs either, so both are as good; nothing else grants a role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# The six services, and "operator": people and tools (kvmesh health, the supervisor's health checks,
# admin calls such as ListWorkers). See docs/security.md.
SERVICE_ROLES = ("gateway", "router", "prefill", "decode", "kvstore", "speculator")
ROLES = (*SERVICE_ROLES, "operator")
# Roles whose server serves only the public client API (kvmesh.runtime.authz.PUBLIC): plaintext behind
# API keys and the ingress, like the HTTP port; their calls into the mesh are mutual TLS all the same.
PLAINTEXT_ROLES = frozenset({"gateway"})
SPIFFE_PREFIX = "spiffe://kvmesh/"
# DNS names in mesh certificates, checked by clients instead of the address they dial (a pod IP, a
# compose service name: nothing a certificate can know). A service dialling a role checks
# ``server_name(role)``, which only that role's certificate carries; a tool that only needs some
# mesh member (health checks) checks MESH_SERVER_NAME, which every certificate carries.
MESH_SERVER_NAME = "kvmesh.mesh"


def spiffe_id(role: str) -> str:
    return SPIFFE_PREFIX + role


def server_name(role: str) -> str:
    """The DNS name only ``role``'s certificate carries: what a service checks when it dials that role."""
    return f"{role}.{MESH_SERVER_NAME}"


def certificate_role(pem: bytes) -> str | None:
    """The role a PEM certificate names in its URI SAN (None: no kvmesh role)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u.encode() for u in sans.get_values_for_type(x509.UniformResourceIdentifier)]
    except x509.ExtensionNotFound:
        uris = []
    cns = [str(a.value).encode() for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
    return peer_role({"x509_subject_alternative_name": uris, "x509_common_name": cns})


def peer_role(auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
    """The role a verified peer certificate names, or None (no TLS, no certificate, no kvmesh role).
    ``auth_context`` is grpc's ``ServicerContext.auth_context()``: grpc only fills the SANs once the
    chain was verified against the server's CA."""
    for uri in auth_context.get("x509_subject_alternative_name", ()):
        text = uri.decode(errors="replace")
        if text.startswith(SPIFFE_PREFIX) and text[len(SPIFFE_PREFIX) :] in ROLES:
            return text[len(SPIFFE_PREFIX) :]
    for cn in auth_context.get("x509_common_name", ()):
        if cn.decode(errors="replace") in ROLES:
            return cn.decode()
    return None
