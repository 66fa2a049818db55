"""The public ``kvmesh.api.gateway.v1.GatewayService``: protobuf in, gateway core calls, protobuf out.

Every call first checks the caller's API key (``authorization: Bearer <key>``
metadata) with the same ``ApiKeys`` the HTTP API uses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.runtime import GrpcService, current_request_id, new_request_id
from services.gateway.auth import ApiKeys
from services.gateway.core import Gateway


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway, keys: ApiKeys) -> None:
        self._gateway = gateway
        self._keys = keys

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self._keys.tenant_from_metadata(context.invocation_metadata())

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        # aclosing: when the client cancels, the core's generator is closed now
        # (not at garbage collection), which cancels the downstream calls.
        tenant = self._tenant(context)
        async with aclosing(self._gateway.generate(request, _request_id(), tenant)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Chat(
        self, request: gateway_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.ChatResponse]:
        tenant = self._tenant(context)
        async with aclosing(self._gateway.chat(request, _request_id(), tenant)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Tokenize(
        self, request: gateway_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.TokenizeResponse:
        self._tenant(context)
        return gateway_pb2.TokenizeResponse(token_ids=await self._gateway.tokenize(request))

    async def Detokenize(
        self, request: gateway_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DetokenizeResponse:
        self._tenant(context)
        return gateway_pb2.DetokenizeResponse(text=await self._gateway.detokenize(request))

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        self._tenant(context)
        return gateway_pb2.ListModelsResponse(models=await self._gateway.list_models())

    async def LoadAdapter(
        self, request: gateway_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.LoadAdapterResponse:
        self._keys.admin_from_metadata(context.invocation_metadata())
        return await self._gateway.load_adapter(request.name, request.path)

    async def UnloadAdapter(
        self, request: gateway_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.UnloadAdapterResponse:
        self._keys.admin_from_metadata(context.invocation_metadata())
        return await self._gateway.unload_adapter(request.name)


def _request_id() -> str:
    # The runtime's interceptor binds one for every call; the fallback serves direct calls.
    return current_request_id() or new_request_id()


def gateway_service(gateway: Gateway, keys: ApiKeys) -> GrpcService:
    """The servicer registered the way ``ServiceDef`` wants it."""
    return GrpcService.of(
        gateway_pb2,
        gateway_pb2_grpc,
        "GatewayService",
        GatewayServicer(gateway, keys),
    )
