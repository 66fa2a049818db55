"""Bearer API keys: who is calling, for both the HTTP and the gRPC API.

Keys come from a file (one ``key [tenant]`` per line; blank lines and ``#``
comments skipped) and/or a comma-separated list of the same entries (the
``KVMESH_API_KEYS`` variable). No keys at all: auth is off and every caller is
the anonymous tenant "".

A tenant scopes prefix caching: the gateway folds it into each request's cache
salt, so one tenant's cached prefixes are never reachable by another's
requests. A key listed without a tenant is a tenant of its own.

Keys are held only as SHA-256 digests and looked up by the digest of the
presented key, so a lookup's timing says nothing about how much of a key
matched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvmesh.errors import PermissionDenied, Unauthenticated

# The gRPC metadata key (lowercase, as gRPC requires) and the HTTP header.
AUTHORIZATION = "authorization"
# The HTTP paths (prefixes) that need an API key when keys are configured: the API, not health or metrics.
GUARDED_PATHS = ("/v1/", "/tokenize", "/detokenize")
# Anthropic's clients send the same key in this HTTP header instead.
X_API_KEY = "x-api-key"
ANONYMOUS = ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, entries: Iterable[str] = (), admin_tenants: Iterable[str] = ()) -> None:
        """``admin_tenants``: the tenants whose keys may call the admin API (loading LoRA adapters)."""
        self._admins = frozenset(t.strip() for t in admin_tenants if t.strip())
        self._tenants: dict[bytes, str] = {}
        for entry in entries:
            fields = entry.split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(f"an API key entry is 'key [tenant]', got {len(fields)} fields")
            key = fields[0]
            tenant = fields[1] if len(fields) == 2 else "key-" + _digest(key).hex()[:16]
            self._tenants[_digest(key)] = tenant

    @classmethod
    def load(cls, path: str | Path | None = None, listed: str | None = None, admins: str | None = None) -> ApiKeys:
        """Keys from ``path`` (a file) and ``listed`` (comma-separated entries); either may be unset.
        ``admins``: comma-separated tenants allowed the admin API."""
        entries: list[str] = []
        if path:
            lines = Path(path).read_text().splitlines()
            entries += [line for line in lines if not line.lstrip().startswith("#")]
        if listed:
            entries += listed.split(",")
        return cls(entries, (admins or "").split(","))

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant from an ``Authorization`` value; Unauthenticated when auth is on and it is wrong."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        tenant = self._tenants.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant

    def admin(self, authorization: str | None) -> str:
        """The caller's tenant when it may call the admin API: anyone while auth is off, else only a key
        of an admin tenant (PermissionDenied for the others, Unauthenticated for a wrong key)."""
        tenant = self.tenant(authorization)
        if self.enabled and tenant not in self._admins:
            raise PermissionDenied(
                "this is an admin call: it needs the key of a tenant named in --admin-tenants (KVMESH_ADMIN_TENANTS)"
            )
        return tenant

    def tenant_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> str:
        """The same check on gRPC invocation metadata."""
        return self.tenant(_authorization(metadata))

    def admin_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> str:
        return self.admin(_authorization(metadata))


def http_authorization(headers: Mapping[str, str]) -> str | None:
    """An HTTP request's credentials as an ``Authorization`` value: that header, or else ``x-api-key``."""
    key = headers.get(X_API_KEY)
    return headers.get(AUTHORIZATION) or (f"Bearer {key}" if key is not None else None)


def _authorization(metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> str | None:
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata or ()
    return next((v for k, v in pairs if k == AUTHORIZATION and isinstance(v, str)), None)


def tenant_cache_salt(tenant: str, salt: str) -> bytes:
    """The cache salt a request runs with: its own salt, scoped to its tenant.

    The tenant is length-prefixed, so no (tenant, salt) pair can spell another
    pair's salt. The anonymous tenant keeps the request's salt as it is.
    """
    if tenant == ANONYMOUS:
        return salt.encode()
    scope = tenant.encode()
    return b"%d:" % len(scope) + scope + salt.encode()


def tenant_digest(tenant: str) -> str:
    """How traces and logs name a tenant: a short hash, never its name or a key."""
    return hashlib.sha256(b"kvmesh-tenant:" + tenant.encode()).hexdigest()[:16]
