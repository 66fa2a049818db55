"""Which role may call which method: the mesh's authorization table, one place (docs/security.md shows it).

With mutual TLS on, every call to a service's own RPCs is checked against ``CALLERS`` by the server
interceptor: a caller whose certificate names another role gets PERMISSION_DENIED naming its role and
the method; a method missing from the table is refused to everyone, so a new RPC is closed until
someone decides who calls it. ``PUBLIC`` services (the gateway's client API) take any caller: their
own API keys decide. Health and reflection are outside the table: any mesh certificate may ask.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.errors import PermissionDenied

PUBLIC = "*"

_WORKERS = frozenset({"prefill", "decode"})
_REGISTERS = frozenset({"prefill", "decode", "kvstore"})  # everything the router lists as a worker
_OPERATOR = frozenset({"operator"})

CALLERS: Mapping[str, Mapping[str, frozenset[str] | str]] = {
    # The client API: anyone who reaches it, with an API key when keys are configured.
    "kvmesh.api.gateway.v1.GatewayService": PUBLIC,
    "kvmesh.api.router.v1.RouterService": {
        "Route": frozenset({"gateway"}),
        "RegisterWorker": _REGISTERS,
        "Heartbeat": _REGISTERS,
        "DeregisterWorker": _REGISTERS,
        "PublishKVEvents": _REGISTERS,
        "ResyncWorker": _REGISTERS,
        # The gateway finds the workers to load a LoRA adapter on, and the adapters /v1/models lists.
        "ListWorkers": frozenset({"gateway", "operator"}),
    },
    "kvmesh.api.prefill.v1.PrefillService": {
        # Only the gateway starts work, so only it names a tenant's cache salt.
        "Prefill": frozenset({"gateway"}),
        # A lease's blocks go to a decode worker only: the gRPC pull and the NIXL descriptors alike.
        "PullKV": frozenset({"decode"}),
        "NixlHandshake": frozenset({"decode"}),
        "ReleaseLease": frozenset({"gateway", "decode"}),
    },
    "kvmesh.api.decode.v1.DecodeService": {"Decode": frozenset({"gateway"})},
    "kvmesh.api.kvstore.v1.KVStoreService": {
        "Put": _WORKERS,
        "Get": _WORKERS,
        "Lookup": _WORKERS,
        "NixlHandshake": _WORKERS,
        "PutNixl": _WORKERS,
        "GetNixl": _WORKERS,
        "Delete": _OPERATOR,
        "Stats": _OPERATOR,
    },
    # LoRA adapters on prefill and decode workers: the gateway's admin API loads them everywhere.
    "kvmesh.api.adapter.v1.AdapterService": {
        "LoadAdapter": frozenset({"gateway", "operator"}),
        "UnloadAdapter": frozenset({"gateway", "operator"}),
        "ListAdapters": frozenset({"gateway", "operator"}),
    },
    "kvmesh.api.speculator.v1.SpeculatorService": {
        "Propose": frozenset({"decode"}),
        "Stats": _OPERATOR,
    },
}


def is_public(service: str) -> bool:
    """Whether ``service`` takes callers without a mesh certificate."""
    return CALLERS.get(service) == PUBLIC


def allowed(service: str, method: str) -> frozenset[str] | str:
    """The roles that may call ``service``/``method`` (``PUBLIC``: anyone; empty: no one)."""
    rule = CALLERS.get(service, {})
    if rule == PUBLIC:
        return PUBLIC
    assert not isinstance(rule, str)
    return rule.get(method, frozenset())


def authorize(service: str, method: str, role: str | None) -> None:
    """Raise PermissionDenied unless ``role`` may call ``service``/``method``."""
    roles = allowed(service, method)
    if roles == PUBLIC or role in roles:
        return
    who = f"role {role!r}" if role else "a caller without a mesh role"
    if not roles:
        raise PermissionDenied(f"{who} may not call {service}/{method}: no role may")
    raise PermissionDenied(f"{who} may not call {service}/{method} (allowed: {', '.join(sorted(roles))})")
