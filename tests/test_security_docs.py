"""docs/security.md's table is the authorization table the servers enforce, and the table covers every RPC."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.api.speculator.v1 import speculator_pb2
from kvmesh.errors import PermissionDenied
from kvmesh.runtime.authz import CALLERS, PUBLIC, allowed, authorize
from kvmesh.runtime.identity import ROLES
from scripts.authz_edges import edges

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
CALLERS_JSON = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "kvmesh" / "files" / "callers.json"
ROW = re.compile(r"^\| `([\w.]+)` \| (?:`(\w+)`|every method) \| ([^|]+) \|$")


def _services():
    for module in (gateway_pb2, router_pb2, prefill_pb2, decode_pb2, kvstore_pb2, speculator_pb2):
        yield from module.DESCRIPTOR.services_by_name.values()


def test_every_rpc_of_every_service_has_its_callers_named() -> None:
    for service in _services():
        rule = CALLERS[service.full_name]
        if rule == PUBLIC:
            continue
        assert set(rule) == {m.name for m in service.methods}, service.full_name
        for roles in rule.values():
            assert roles and roles <= set(ROLES)


def test_the_docs_table_is_the_code_table() -> None:
    documented: dict[tuple[str, str | None], str] = {}
    for line in DOC.read_text().splitlines():
        if m := ROW.match(line):
            documented[(m.group(1), m.group(2))] = m.group(3).strip()
    expected = {}
    for service, rule in CALLERS.items():
        if rule == PUBLIC:
            expected[(service, None)] = "anyone (the gateway's API keys decide)"
        else:
            expected |= {(service, method): ", ".join(sorted(roles)) for method, roles in rule.items()}
    assert documented == expected


def test_a_method_nobody_listed_is_closed_to_everyone() -> None:
    assert allowed("kvmesh.api.decode.v1.DecodeService", "Shiny") == frozenset()
    for role in ROLES:
        with pytest.raises(PermissionDenied, match="no role may"):
            authorize("kvmesh.api.decode.v1.DecodeService", "Shiny", role)


def test_the_charts_edges_are_the_code_table() -> None:
    """deploy/helm/kvmesh/files/callers.json (the NetworkPolicies' source) is scripts/authz_edges.py's output."""
    assert json.loads(CALLERS_JSON.read_text()) == edges()
