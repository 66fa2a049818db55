"""API keys: one check for the HTTP and the gRPC API; tenants scope the prefix cache."""

from __future__ import annotations

import aiohttp
import grpc
import openai
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.errors import Unauthenticated
from kvmesh.runtime import parse_flags, serve
from services.gateway.auth import ApiKeys, tenant_cache_salt
from services.gateway.main import FLAGS, build
from tests.gateway.fakes import FakeMesh
from tests.gateway.grpc_fakes import TOKENS, Mesh, build_mesh
from tests.gateway.helpers import PROMPT, gateway_argv
from tests.gateway.test_http_api import http_gateway
from tests.service_helpers import free_port

KEYS = ApiKeys(["k-alice alice", "k-bob bob", "k-solo"])


def test_keys_from_a_file_and_a_list(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# operators\nk1 team-a\n\n  k2\n")
    keys = ApiKeys.load(path, "k3 team-c, k4")

    assert keys.enabled
    assert [keys.tenant(f"Bearer k{i}") for i in (1, 3)] == ["team-a", "team-c"]
    # A key without a tenant is a tenant of its own.
    assert keys.tenant("Bearer k2").startswith("key-") and keys.tenant("Bearer k2") != keys.tenant("Bearer k4")


def test_no_keys_means_auth_off() -> None:
    keys = ApiKeys.load(None, "")
    assert not keys.enabled and keys.tenant(None) == "" and keys.tenant("Bearer anything") == ""


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, "missing API key"),
        ("k-alice", "missing API key"),
        ("Bearer ", "missing API key"),
        ("Bearer k-eve", "invalid API key"),
        ("Basic k-alice", "missing API key"),
    ],
)
def test_wrong_credentials_are_unauthenticated(authorization, message) -> None:
    with pytest.raises(Unauthenticated, match=message):
        KEYS.tenant(authorization)


def test_a_bad_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="'key \\[tenant\\]', got 3 fields"):
        ApiKeys(["k1 tenant extra"])


def test_tenant_salts_cannot_collide() -> None:
    assert tenant_cache_salt("", "s") == b"s"  # auth off: the request's own salt
    assert tenant_cache_salt("ab", "c") != tenant_cache_salt("a", "bc")
    assert tenant_cache_salt("alice", "") != tenant_cache_salt("bob", "")


async def test_http_needs_a_key_and_scopes_the_cache_to_the_tenant(model) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh, keys=KEYS) as served:
        with pytest.raises(openai.AuthenticationError) as wrong:
            await served.client(api_key="k-eve").models.list()
        await served.client(api_key="k-alice").completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        await served.client(api_key="k-bob").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"cache_salt": "x"}
        )
        async with aiohttp.ClientSession() as http:
            async with http.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) as r:
                missing = (r.status, (await r.json())["error"]["message"])
            open_routes = []
            for path in ("/health", "/metrics", "/openapi.json"):
                async with http.get(served.url + path) as r:
                    open_routes.append(r.status)
                    if path == "/openapi.json":
                        document = await r.json()

    assert missing == (401, "missing API key: send the header 'Authorization: Bearer <key>'")
    assert wrong.value.status_code == 401
    assert wrong.value.body == {
        "message": "invalid API key",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert [r.cache_salt for r in mesh.routes] == [b"5:alice", b"3:bobx"]
    assert open_routes == [200, 200, 200]
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    assert document["paths"]["/v1/messages"]["post"]["security"] == [{"bearer": []}, {"apiKey": []}]
    assert "401" in document["paths"]["/v1/completions"]["post"]["responses"]


async def test_grpc_uses_the_same_keys(model_dir) -> None:
    mesh = Mesh()
    async with serve("mesh", build_mesh(mesh), metrics_port=None) as mesh_rt:
        mesh.address = f"127.0.0.1:{mesh_rt.port}"
        argv = gateway_argv(mesh.address, model_dir, free_port(), "--api-keys", "k-alice alice")
        async with serve("gateway", build, parse_flags("kvmesh-gateway", FLAGS, argv, environ={})) as rt:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT))
                with pytest.raises(grpc.aio.AioRpcError) as wrong:
                    [c async for c in stub.Generate(request, metadata=(("authorization", "Bearer k-eve"),))]
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await stub.ListModels(gateway_pb2.ListModelsRequest())
                good = (("authorization", "Bearer k-alice"),)
                chunks = [c async for c in stub.Generate(request, metadata=good)]
                models = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=good)

    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED and wrong.value.details() == "invalid API key"
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [t for c in chunks for t in c.token_ids] == TOKENS and models.models[0].id == "tiny"


def test_only_admin_tenants_may_call_the_admin_api() -> None:
    from kvmesh.errors import PermissionDenied

    keys = ApiKeys.load(None, "k-ops ops, k-alice alice", "ops")
    assert keys.admin("Bearer k-ops") == "ops"
    with pytest.raises(PermissionDenied, match="admin call"):
        keys.admin("Bearer k-alice")
    with pytest.raises(Unauthenticated):
        keys.admin("Bearer k-eve")
    assert ApiKeys.load(None, "").admin(None) == ""  # auth off: anyone


async def test_http_admin_api_loads_on_every_worker_for_admins_only(model) -> None:
    mesh = FakeMesh()
    keys = ApiKeys(["k-ops ops", "k-alice alice"], ["ops"])
    body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    async with http_gateway(model, mesh, keys=keys) as served, aiohttp.ClientSession() as http:
        async with http.post(served.url + "/v1/load_lora_adapter", json=body, headers=_bearer("k-alice")) as r:
            assert r.status == 403
        assert not any(mesh.adapters.values())
        async with http.post(served.url + "/v1/load_lora_adapter", json=body, headers=_bearer("k-ops")) as r:
            assert r.status == 200 and (await r.json())["parent"] == "tiny"
        assert all(names == {"sql"} for names in mesh.adapters.values())
        async with http.get(served.url + "/v1/models/sql", headers=_bearer("k-alice")) as r:
            assert r.status == 200 and (await r.json())["id"] == "sql"
        await served.client(api_key="k-alice").completions.create(model="sql", prompt=PROMPT, max_tokens=4)
        assert mesh.decodes[-1][1].adapter == "sql"
        unload = {"lora_name": "sql"}
        async with http.post(served.url + "/v1/unload_lora_adapter", json=unload, headers=_bearer("k-ops")) as r:
            assert r.status == 200 and (await r.json())["deleted"]
        async with http.post(served.url + "/v1/unload_lora_adapter", json=unload, headers=_bearer("k-ops")) as r:
            assert r.status == 404


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
