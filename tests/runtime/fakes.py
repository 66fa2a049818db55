"""Tiny servicers over the real generated contracts, built to misbehave on request.

KVStore methods pick their behaviour from the first block hash:
b"invalid" -> InvalidArgument, b"crash" -> RuntimeError, b"abort" -> the
servicer aborts with PERMISSION_DENIED itself, b"slow" -> a 0.3 s pause.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.runtime import GrpcService, ServiceContext, ServiceDef, create_channel

log = structlog.get_logger("tests.fakes")

SECRET = "secret-detail-4711"  # must never reach a client


async def _misbehave(block_hash: bytes, context: grpc.aio.ServicerContext) -> None:
    if block_hash == b"invalid":
        raise InvalidArgument("bad hash chain")
    if block_hash == b"missing":
        raise NotFound("block gone")
    if block_hash == b"crash":
        raise RuntimeError(SECRET)
    if block_hash == b"abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "denied by servicer")
    if block_hash == b"slow":
        await asyncio.sleep(0.3)


class FakeKVStore(kvstore_pb2_grpc.KVStoreServiceServicer):
    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsResponse:
        log.info("stats called")
        return kvstore_pb2.StatsResponse(ram_blocks=7)

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        for h in request.block_hashes:
            await _misbehave(h, context)
        return kvstore_pb2.LookupResponse(num_present_prefix=len(request.block_hashes))

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetResponse]:
        for h in request.block_hashes:
            await _misbehave(h, context)
            yield kvstore_pb2.GetResponse(missing_block_hash=h)
        yield kvstore_pb2.GetResponse(summary=kvstore_pb2.GetSummary(missing_blocks=len(request.block_hashes)))

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        stored = 0
        async for req in request_iterator:
            await _misbehave(req.chunk.block_hash, context)
            stored += 1
        return kvstore_pb2.PutResponse(stored_blocks=stored)


class FakeSpeculator(speculator_pb2_grpc.SpeculatorServiceServicer):
    """Proposes the last context token repeated, or fails on request id "crash"."""

    async def Propose(
        self, request_iterator: AsyncIterator[speculator_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[speculator_pb2.ProposeResponse]:
        async for req in request_iterator:
            ctx = req.context
            if ctx.request_id == "crash":
                raise RuntimeError(SECRET)
            yield speculator_pb2.ProposeResponse(
                request_id=ctx.request_id,
                context_length=ctx.context_length,
                draft_token_ids=[ctx.token_ids[-1]] * ctx.num_draft_tokens,
            )


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """ListWorkers calls the kvstore, so a request crosses two services."""

    def __init__(self, kvstore_address: str) -> None:
        self._kvstore_address = kvstore_address

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        log.info("listing workers")
        async with create_channel(self._kvstore_address) as channel:
            await kvstore_pb2_grpc.KVStoreServiceStub(channel).Stats(kvstore_pb2.StatsRequest())
        return router_pb2.ListWorkersResponse()


KVSTORE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"]
SPECULATOR = speculator_pb2.DESCRIPTOR.services_by_name["SpeculatorService"]
ROUTER = router_pb2.DESCRIPTOR.services_by_name["RouterService"]


def build_kvstore(ctx: ServiceContext) -> ServiceDef:
    return ServiceDef(
        services=[
            GrpcService(KVSTORE, kvstore_pb2_grpc.add_KVStoreServiceServicer_to_server, FakeKVStore()),
            GrpcService(SPECULATOR, speculator_pb2_grpc.add_SpeculatorServiceServicer_to_server, FakeSpeculator()),
        ]
    )


def build_router(kvstore_address: str) -> Callable[[ServiceContext], ServiceDef]:
    def build(ctx: ServiceContext) -> ServiceDef:
        servicer = FakeRouter(kvstore_address)
        return ServiceDef(services=[GrpcService(ROUTER, router_pb2_grpc.add_RouterServiceServicer_to_server, servicer)])

    return build
