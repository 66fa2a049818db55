"""``Backends`` over gRPC: one cached channel per address, deadlines, status codes -> domain errors.

Every unary call has a deadline, so a hung peer fails the call instead of
hanging the request; a dead one fails at once (no wait-for-ready). The decode
stream has no deadline (generations are long); the core bounds the silence
between its messages instead.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, TypeVar

import grpc

from kvmesh.api.adapter.v1 import adapter_pb2, adapter_pb2_grpc
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.runtime import create_channel
from kvmesh.runtime.client_errors import from_rpc_error
from services.gateway.backends import RouterUnreachable

Stub = TypeVar("Stub")

# The role at the other end of each stub: its channel talks only to a server whose certificate names it.
_PEER = {
    router_pb2_grpc.RouterServiceStub: "router",
    prefill_pb2_grpc.PrefillServiceStub: "prefill",
    decode_pb2_grpc.DecodeServiceStub: "decode",
}


# Once the router was unreachable, Route calls get this deadline until one is answered: during an outage
# (a partitioned router host answers nothing) each request falls back to the last known workers within a
# second instead of waiting out the full deadline, and the first answer restores it.
SUSPECT_ROUTE_TIMEOUT_S = 1.0


class GrpcBackends:
    def __init__(
        self,
        router_address: str,
        *,
        rpc_timeout_s: float = 10.0,
        prefill_timeout_s: float = 600.0,
        suspect_route_timeout_s: float = SUSPECT_ROUTE_TIMEOUT_S,
    ) -> None:
        self._router_address = router_address
        self._rpc_timeout_s = rpc_timeout_s
        self._prefill_timeout_s = prefill_timeout_s
        self._suspect_route_timeout_s = min(suspect_route_timeout_s, rpc_timeout_s)
        self._router_suspect = False  # its last Route call found it unreachable
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[type, str], Any] = {}

    def _stub(self, cls: type[Stub], address: str, peer: str | None = None) -> Stub:
        """``peer``: the role the server must name, for a service several roles serve (AdapterService)."""
        key = (cls, address)
        if key not in self._stubs:
            if address not in self._channels:
                self._channels[address] = create_channel(address, peer=peer or _PEER[cls])
            self._stubs[key] = cls(self._channels[address])
        return self._stubs[key]

    async def route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        stub = self._stub(router_pb2_grpc.RouterServiceStub, self._router_address)
        timeout = self._suspect_route_timeout_s if self._router_suspect else self._rpc_timeout_s
        try:
            plan = await stub.Route(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            error = from_rpc_error(e, f"router ({self._router_address})", timeout)
            self._router_suspect = _unreachable(e, self._channels[self._router_address])
            if self._router_suspect:
                raise RouterUnreachable(error.message) from None
            raise error from None
        self._router_suspect = False
        return plan

    async def prefill(self, address: str, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        stub = self._stub(prefill_pb2_grpc.PrefillServiceStub, address)
        try:
            return await stub.Prefill(request, timeout=self._prefill_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "", self._prefill_timeout_s) from None

    async def release_lease(
        self, address: str, request: prefill_pb2.ReleaseLeaseRequest
    ) -> prefill_pb2.ReleaseLeaseResponse:
        stub = self._stub(prefill_pb2_grpc.PrefillServiceStub, address)
        try:
            return await stub.ReleaseLease(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"prefill worker ({address})", self._rpc_timeout_s) from None

    async def decode(
        self, address: str, request: decode_pb2.DecodeRequest
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        call = self._stub(decode_pb2_grpc.DecodeServiceStub, address).Decode(request)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "") from None
        finally:
            call.cancel()  # no-op when the stream ended; otherwise the decode worker aborts the sequence

    async def list_workers(self) -> router_pb2.ListWorkersResponse:
        stub = self._stub(router_pb2_grpc.RouterServiceStub, self._router_address)
        try:
            return await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"router ({self._router_address})", self._rpc_timeout_s) from None

    async def load_adapter(
        self, address: str, role: str, request: adapter_pb2.LoadAdapterRequest
    ) -> adapter_pb2.LoadAdapterResponse:
        stub = self._stub(adapter_pb2_grpc.AdapterServiceStub, address, role)
        try:
            # Reading and checking an adapter's files takes longer than a routing call.
            return await stub.LoadAdapter(request, timeout=self._prefill_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"{role} worker ({address})", self._prefill_timeout_s) from None

    async def unload_adapter(
        self, address: str, role: str, request: adapter_pb2.UnloadAdapterRequest
    ) -> adapter_pb2.UnloadAdapterResponse:
        stub = self._stub(adapter_pb2_grpc.AdapterServiceStub, address, role)
        try:
            return await stub.UnloadAdapter(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"{role} worker ({address})", self._rpc_timeout_s) from None

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


def _unreachable(error: grpc.aio.AioRpcError, channel: grpc.aio.Channel) -> bool:
    """The peer was never asked (no connection) or never answered (deadline): not an answer of its own.

    Both kinds come back as UNAVAILABLE; a peer that answered leaves its channel READY.
    """
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return error.code() == grpc.StatusCode.UNAVAILABLE and channel.get_state() != grpc.ChannelConnectivity.READY
