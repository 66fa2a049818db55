"""LoRA adapters in the gateway core: a model name resolves to an adapter, loading fans out to every
worker all-or-nothing, and the adapter's name travels to the router, prefill and decode."""

from __future__ import annotations

import pytest

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

from .fakes import FakeMesh
from .helpers import collect, make_gateway, request


async def test_loading_reaches_every_worker_and_requests_carry_the_adapter(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    loaded = await gateway.load_adapter("sql", "/adapters/sql")
    assert (loaded.model.id, loaded.model.parent, loaded.workers) == ("sql", "tiny", 4)
    assert all(names == {"sql"} for names in mesh.adapters.values())
    assert [(m.id, m.parent) for m in await gateway.list_models()] == [("tiny", ""), ("sql", "tiny")]

    req = request()
    req.model = "sql"
    await collect(gateway, req)
    assert mesh.routes[-1].adapter == "sql"
    assert mesh.prefills[-1][1].adapter == "sql"
    assert mesh.decodes[-1][1].adapter == "sql"

    req.model = ""  # the base model: no adapter anywhere
    await collect(gateway, req)
    assert (mesh.routes[-1].adapter, mesh.prefills[-1][1].adapter, mesh.decodes[-1][1].adapter) == ("", "", "")


async def test_a_worker_refusing_an_adapter_leaves_it_loaded_nowhere(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    await gateway.load_adapter("kept", "/adapters/kept")
    mesh.adapter_errors["d1"] = InvalidArgument("/adapters/bad: layers.0.q_proj: lora_A (8, 5) and lora_B ...")
    with pytest.raises(InvalidArgument, match="lora_A"):
        await gateway.load_adapter("bad", "/adapters/bad")
    assert all(names == {"kept"} for names in mesh.adapters.values())
    # Loading an adapter again where it is already loaded, when another worker refuses, keeps the old copies.
    mesh.adapter_errors["d1"] = Unavailable("decode worker (d1:1): connection refused")
    with pytest.raises(Unavailable):
        await gateway.load_adapter("kept", "/adapters/kept")
    assert all(names == {"kept"} for names in mesh.adapters.values())


async def test_unknown_models_unload_and_names(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    req = request()
    req.model = "sql"
    with pytest.raises(NotFound, match="model 'sql' is not served here; this gateway serves 'tiny'"):
        await collect(gateway, req)
    await gateway.load_adapter("sql", "/adapters/sql")
    assert (await gateway.unload_adapter("sql")).workers == 4
    with pytest.raises(NotFound, match="not loaded on any worker"):
        await gateway.unload_adapter("sql")
    with pytest.raises(InvalidArgument, match="other than the base model"):
        await gateway.load_adapter("tiny", "/adapters/sql")


async def test_unload_refused_by_a_busy_worker_is_reported(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    await gateway.load_adapter("sql", "/adapters/sql")

    async def busy(address, role, req):
        raise FailedPrecondition("adapter 'sql' serves 1 request(s); unload it after")

    mesh.unload_adapter = busy
    with pytest.raises(FailedPrecondition, match="serves 1 request"):
        await gateway.unload_adapter("sql")


async def test_tokenize_accepts_an_adapter_name(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    await gateway.load_adapter("sql", "/adapters/sql")
    ids = await gateway.tokenize(gateway_pb2.TokenizeRequest(model="sql", text="x = 1"))
    assert ids == await gateway.tokenize(gateway_pb2.TokenizeRequest(text="x = 1"))
