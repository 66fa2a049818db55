"""LoRA adapters on a worker (prefill, decode): the ``AdapterService`` servicer, the adapters named by
``--lora`` loaded at start, and what the router hears about them.

Loading reads and checks files, so it runs off the event loop (the engine's adapter registry is
thread-safe: ``kvmesh.engine.lora``). Every change is reported to the router at once (an immediate
heartbeat) and the call returns once the router acknowledged it, so requests naming the adapter can
then be routed here (within the RPC timeout; past it the worker answers anyway and logs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import grpc
import structlog

from kvmesh.api.adapter.v1 import adapter_pb2, adapter_pb2_grpc
from kvmesh.api.common.v1 import worker_pb2
from kvmesh.errors import Unavailable

if TYPE_CHECKING:  # the kvstore imports this package without torch
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.lora import AdapterInfo

log = structlog.get_logger(__name__)


def adapter_states(engine: LLMEngine) -> list[worker_pb2.AdapterState]:
    """The engine's adapters as a heartbeat reports them."""
    return [
        worker_pb2.AdapterState(name=a.name, fingerprint=a.fingerprint, resident=a.resident) for a in engine.adapters()
    ]


async def load_startup_adapters(engine: LLMEngine, specs: Iterable[tuple[str, str]]) -> None:
    """Load ``--lora``'s adapters; a bad one fails the start with the reason (InvalidArgument)."""
    for name, path in specs:
        info = await asyncio.to_thread(engine.load_adapter, name, path)
        log.info("lora_adapter_loaded", adapter=name, path=path, rank=info.rank)


def _to_pb(info: AdapterInfo) -> adapter_pb2.Adapter:
    return adapter_pb2.Adapter(
        name=info.name, path=info.path, rank=info.rank, fingerprint=info.fingerprint, resident=info.resident
    )


class AdapterServicer(adapter_pb2_grpc.AdapterServiceServicer):
    """Serves once ``attach`` gave it the engine; until then UNAVAILABLE."""

    def __init__(self) -> None:
        self._engine: LLMEngine | None = None
        self._changed: Callable[[], Awaitable[bool]] | None = None

    def attach(self, engine: LLMEngine, on_change: Callable[[], Awaitable[bool]] | None) -> None:
        """``on_change`` is awaited after every load or unload, before the answer goes out (the router link
        reporting the change: a request naming a just-loaded adapter must find this worker; False: not
        acknowledged in time)."""
        self._engine, self._changed = engine, on_change

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise Unavailable("this worker is still loading its model")
        return self._engine

    async def LoadAdapter(
        self, request: adapter_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> adapter_pb2.LoadAdapterResponse:
        info = await asyncio.to_thread(self.engine.load_adapter, request.name, request.path)
        log.info("lora_adapter_loaded", adapter=request.name, path=request.path, rank=info.rank)
        await self._report(request.name)
        return adapter_pb2.LoadAdapterResponse(adapter=_to_pb(info))

    async def UnloadAdapter(
        self, request: adapter_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> adapter_pb2.UnloadAdapterResponse:
        self.engine.unload_adapter(request.name)
        log.info("lora_adapter_unloaded", adapter=request.name)
        await self._report(request.name)
        return adapter_pb2.UnloadAdapterResponse()

    async def _report(self, name: str) -> None:
        if self._changed is not None and not await self._changed():
            log.warning("lora_adapter_change_not_yet_acknowledged", adapter=name)

    async def ListAdapters(
        self, request: adapter_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> adapter_pb2.ListAdaptersResponse:
        return adapter_pb2.ListAdaptersResponse(adapters=[_to_pb(a) for a in self.engine.adapters()])
