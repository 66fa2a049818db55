"""Health follows the life cycle (NOT_SERVING -> SERVING -> NOT_SERVING), RPCs wait for readiness,
reflection lists the services."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime import Runtime, ServiceContext, ServiceDef
from tests.runtime.fakes import build_kvstore

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return resp.status


async def test_health_life_cycle_and_readiness_gate() -> None:
    may_finish_start = asyncio.Event()
    seen: list[tuple[str, int]] = []
    runtime: Runtime

    def build(ctx: ServiceContext) -> ServiceDef:
        base = build_kvstore(ctx)

        async def start() -> None:
            seen.append(("start", await _health(runtime.port)))
            await may_finish_start.wait()

        async def drain() -> None:
            seen.append(("drain", await _health(runtime.port)))

        async def stop() -> None:
            seen.append(("stop", -1))

        return ServiceDef(services=base.services, start=start, drain=drain, stop=stop)

    runtime = Runtime("kvstore", build, metrics_port=None, grace_seconds=1)
    starting = asyncio.create_task(runtime.start())
    while not seen:
        await asyncio.sleep(0.01)
    assert seen == [("start", NOT_SERVING)]
    assert await _health(runtime.port, "kvmesh.api.kvstore.v1.KVStoreService") == NOT_SERVING

    # Not ready yet: the service's own RPCs are refused with UNAVAILABLE.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{runtime.port}") as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        try:
            await stub.Stats(kvstore_pb2.StatsRequest())
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in err.details()
        else:
            raise AssertionError("Stats answered before the service was ready")

        may_finish_start.set()
        await starting
        assert await _health(runtime.port) == SERVING
        assert await _health(runtime.port, "kvmesh.api.kvstore.v1.KVStoreService") == SERVING
        assert (await stub.Stats(kvstore_pb2.StatsRequest())).ram_blocks == 7

    await runtime.stop()
    # The drain hook runs after health flips, before the stop hook.
    assert seen == [("start", NOT_SERVING), ("drain", NOT_SERVING), ("stop", -1)]


async def test_reflection_lists_services(kvstore: Runtime) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{kvstore.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names = set()
        async for resp in stub.ServerReflectionInfo(iter([request])):
            names |= {s.name for s in resp.list_services_response.service}
        assert {
            "kvmesh.api.kvstore.v1.KVStoreService",
            "kvmesh.api.speculator.v1.SpeculatorService",
            "grpc.health.v1.Health",
        } <= names

        # Descriptors resolve too, so grpcurl can call the service by name.
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvmesh.api.kvstore.v1.KVStoreService")
        async for resp in stub.ServerReflectionInfo(iter([request])):
            assert resp.file_descriptor_response.file_descriptor_proto


async def test_failed_start_releases_the_port() -> None:
    def build(ctx: ServiceContext) -> ServiceDef:
        async def start() -> None:
            raise RuntimeError("model folder missing")

        return ServiceDef(services=build_kvstore(ctx).services, start=start)

    runtime = Runtime("kvstore", build, grace_seconds=0)
    try:
        await runtime.start()
    except RuntimeError:
        pass
    else:
        raise AssertionError("start should fail")
    # The same port binds again: nothing was left listening.
    again = Runtime("kvstore", build_kvstore, port=runtime.port, metrics_port=None)
    await again.start()
    assert again.port == runtime.port
    await again.stop()
