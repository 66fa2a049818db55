"""The calls the gateway makes to other services, as an interface the core depends on.

The server layer implements it with gRPC stubs (``grpc_backends.py``); unit
tests implement it with plain objects. Messages are the internal contracts'
protobuf types, passed through unchanged (the KV hand-off in particular).

What an implementation promises the core:
- a peer that cannot be reached, times out, or breaks a stream raises
  ``kvmesh.errors.Unavailable`` (the core retries those on another worker);
  ``route`` raises its subclass ``RouterUnreachable`` when the router itself
  could not be asked (down, or no answer by the deadline), as opposed to the
  router answering UNAVAILABLE (no worker to route to);
- any status the peer itself answered raises the matching ``KvmeshError``;
- closing the ``decode`` iterator (or cancelling the task reading it) cancels
  the downstream call, so the decode worker aborts the sequence and frees its KV;
- cancelling a pending ``prefill`` cancels the call.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from kvmesh.api.adapter.v1 import adapter_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import Unavailable


class RouterUnreachable(Unavailable):
    """The router could not be asked: it is down or did not answer by the deadline."""


class Backends(Protocol):
    async def route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse: ...

    async def prefill(self, address: str, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse: ...

    async def release_lease(
        self, address: str, request: prefill_pb2.ReleaseLeaseRequest
    ) -> prefill_pb2.ReleaseLeaseResponse: ...

    def decode(
        self, address: str, request: decode_pb2.DecodeRequest
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]: ...

    async def list_workers(self) -> router_pb2.ListWorkersResponse: ...

    # A worker's LoRA adapters; ``role`` ("prefill" or "decode") is the one its certificate must name.
    async def load_adapter(
        self, address: str, role: str, request: adapter_pb2.LoadAdapterRequest
    ) -> adapter_pb2.LoadAdapterResponse: ...

    async def unload_adapter(
        self, address: str, role: str, request: adapter_pb2.UnloadAdapterRequest
    ) -> adapter_pb2.UnloadAdapterResponse: ...
