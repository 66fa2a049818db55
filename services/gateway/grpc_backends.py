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

from kvmesh.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.errors import KvmeshError, Unavailable
from kvmesh.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.runtime import create_channel

Stub = TypeVar("Stub")

# Statuses that say "the peer could not do it", not "the request is wrong":
# the core may retry these on another worker. UNAVAILABLE covers both a peer
# that cannot be reached and one that says it cannot serve (not ready, no
# worker), so its details are passed on as they are.
_PEER_FAILED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


def _domain_classes() -> dict[str, type[KvmeshError]]:
    # Derived from kvmesh.errors' own code names, so the mapping stays in one place;
    # the first class declaring a code is its canonical one.
    by_code: dict[str, type[KvmeshError]] = {}
    pending = list(KvmeshError.__subclasses__())
    while pending:
        cls = pending.pop(0)
        by_code.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return by_code


_BY_CODE = _domain_classes()


def domain_error(exc: grpc.aio.AioRpcError, peer: str = "", timeout_s: float | None = None) -> KvmeshError:
    """The domain error for a failed call; ``peer`` (e.g. "router (host:port)") prefixes peer failures."""
    code, details = exc.code(), exc.details() or exc.code().name
    prefix = f"{peer}: " if peer else ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"{prefix}no answer within {timeout_s:g} s" if timeout_s else f"{prefix}{details}")
    if code == grpc.StatusCode.CANCELLED:
        return Unavailable(f"{prefix}the call was cancelled on the server side: {details}")
    if code in _PEER_FAILED:
        return Unavailable(f"{prefix}{details}")
    cls = _BY_CODE.get(code.name)
    if cls is None or cls is KvmeshError:
        return KvmeshError(f"{prefix}{code.name}: {details}")
    return cls(details)  # the peer's own answer about the request: pass it on as it is


class GrpcBackends:
    def __init__(self, router_address: str, *, rpc_timeout_s: float = 10.0, prefill_timeout_s: float = 600.0) -> None:
        self._router_address = router_address
        self._rpc_timeout_s = rpc_timeout_s
        self._prefill_timeout_s = prefill_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[type, str], Any] = {}

    def _stub(self, cls: type[Stub], address: str) -> Stub:
        key = (cls, address)
        if key not in self._stubs:
            if address not in self._channels:
                self._channels[address] = create_channel(address)
            self._stubs[key] = cls(self._channels[address])
        return self._stubs[key]

    async def route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        stub = self._stub(router_pb2_grpc.RouterServiceStub, self._router_address)
        try:
            return await stub.Route(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise domain_error(e, f"router ({self._router_address})", self._rpc_timeout_s) from None

    async def prefill(self, address: str, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        stub = self._stub(prefill_pb2_grpc.PrefillServiceStub, address)
        try:
            return await stub.Prefill(request, timeout=self._prefill_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise domain_error(e, "", self._prefill_timeout_s) from None

    async def release_lease(
        self, address: str, request: prefill_pb2.ReleaseLeaseRequest
    ) -> prefill_pb2.ReleaseLeaseResponse:
        stub = self._stub(prefill_pb2_grpc.PrefillServiceStub, address)
        try:
            return await stub.ReleaseLease(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise domain_error(e, f"prefill worker ({address})", self._rpc_timeout_s) from None

    async def decode(self, address: str, request: decode_pb2.DecodeRequest) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        call = self._stub(decode_pb2_grpc.DecodeServiceStub, address).Decode(request)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as e:
            raise domain_error(e, "") from None
        finally:
            call.cancel()  # no-op when the stream ended; otherwise the decode worker aborts the sequence

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
