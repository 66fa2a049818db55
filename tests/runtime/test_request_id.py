"""The request id comes from metadata (or is made), lands in every log line of the call, and crosses hops."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.runtime import METADATA_KEY, Runtime, create_channel, current_request_id, request_id_scope, serve
from tests.runtime.fakes import build_router


async def test_request_id_from_metadata_is_in_the_logs(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub, logs) -> None:
    await kvstore_stub.Stats(kvstore_pb2.StatsRequest(), metadata=((METADATA_KEY, "req-123"),))
    called = [e for e in logs() if e["event"] == "stats called"]
    assert called and called[0]["request_id"] == "req-123"
    assert called[0]["rpc"] == "/kvmesh.api.kvstore.v1.KVStoreService/Stats"
    done = [e for e in logs() if e["event"] == "rpc done"]
    assert done and done[0]["request_id"] == "req-123" and done[0]["code"] == "OK"


async def test_request_id_is_generated_when_absent(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub, logs) -> None:
    await kvstore_stub.Stats(kvstore_pb2.StatsRequest())
    await kvstore_stub.Stats(kvstore_pb2.StatsRequest())
    ids = [e["request_id"] for e in logs() if e["event"] == "stats called"]
    assert len(ids) == 2 and all(ids) and ids[0] != ids[1]


async def test_request_id_crosses_hops(kvstore: Runtime, logs) -> None:
    async with serve("router", build_router(f"127.0.0.1:{kvstore.port}")) as router:
        # A non-gRPC entry point (e.g. the gateway's HTTP handler) opens a scope;
        # create_channel carries it to the router, which carries it to the kvstore.
        with request_id_scope() as rid:
            assert current_request_id() == rid
            async with create_channel(f"127.0.0.1:{router.port}") as channel:
                await router_pb2_grpc.RouterServiceStub(channel).ListWorkers(router_pb2.ListWorkersRequest())
        assert current_request_id() is None
    events = {e["event"]: e for e in logs()}
    assert events["listing workers"]["request_id"] == rid
    assert events["stats called"]["request_id"] == rid


async def test_every_rpc_kind_carries_it_and_explicit_metadata_wins(kvstore: Runtime, logs) -> None:
    update = speculator_pb2.ContextUpdate(request_id="r", token_ids=[1], context_length=1, num_draft_tokens=1)
    with request_id_scope("outer"):
        async with create_channel(f"127.0.0.1:{kvstore.port}") as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            await stub.Stats(kvstore_pb2.StatsRequest(), metadata=((METADATA_KEY, "explicit"),))
            await stub.Stats(kvstore_pb2.StatsRequest())
            [r async for r in stub.Get(kvstore_pb2.GetRequest(block_hashes=[b"a"]))]
            await stub.Put(iter([kvstore_pb2.PutRequest()]))
            spec = speculator_pb2_grpc.SpeculatorServiceStub(channel)
            [r async for r in spec.Propose(iter([speculator_pb2.ProposeRequest(context=update)]))]
    ids = [(e["rpc"].rsplit("/", 1)[1], e["request_id"]) for e in logs() if e["event"] == "rpc done"]
    assert ids == [("Stats", "explicit"), ("Stats", "outer"), ("Get", "outer"), ("Put", "outer"), ("Propose", "outer")]


async def test_unknown_method_is_unimplemented(kvstore: Runtime) -> None:
    # A servicer method not overridden keeps the generated UNIMPLEMENTED answer.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{kvstore.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kvstore_pb2_grpc.KVStoreServiceStub(channel).Delete(kvstore_pb2.DeleteRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
