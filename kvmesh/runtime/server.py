"""One running service: its gRPC server with the interceptor, health, reflection and /metrics.

A service describes itself with a ``build`` function returning a
``ServiceDef``; ``Runtime`` runs it. The order matters and is fixed here:

start: bind the port and start serving (health says NOT_SERVING, the
interceptor refuses the service's RPCs) -> the service's ``start`` hook (load
the model, connect to Redis, register with the router) -> SERVING.

stop: NOT_SERVING -> the ``drain`` hook (deregister from the router, so no new
work is routed here) -> stop accepting and wait up to the grace period for
in-flight RPCs -> the ``stop`` hook (release resources) -> metrics off.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvmesh.runtime.authz import is_public
from kvmesh.runtime.channel import SERVER_OPTIONS
from kvmesh.runtime.health import Health
from kvmesh.runtime.interceptor import ServerInterceptor
from kvmesh.runtime.metrics import MetricsServer, RpcMetrics, new_registry
from kvmesh.runtime.tls import TlsFiles, server_credentials

log = structlog.get_logger("kvmesh.runtime")

Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class GrpcService:
    """A servicer and how to register it (``of`` reads both from the generated modules)."""

    descriptor: ServiceDescriptor
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: object

    @classmethod
    def of(cls, pb2: ModuleType, pb2_grpc: ModuleType, name: str, servicer: object) -> GrpcService:
        """Service ``name`` of the generated ``pb2``/``pb2_grpc`` modules, served by ``servicer``, e.g.
        ``GrpcService.of(kvstore_pb2, kvstore_pb2_grpc, "KVStoreService", KVStoreServicer(store))``."""
        return cls(pb2.DESCRIPTOR.services_by_name[name], getattr(pb2_grpc, f"add_{name}Servicer_to_server"), servicer)


@dataclass(frozen=True)
class ServiceDef:
    """What a service's ``build`` hands the runtime. Hooks are optional coroutines."""

    services: Sequence[GrpcService]
    # After the port is bound; SERVING once it returns. If it raises, it cleans
    # up after itself: the process then exits without calling drain or stop.
    start: Hook | None = None
    drain: Hook | None = None  # when shutdown begins, before the server stops accepting
    stop: Hook | None = None  # after in-flight RPCs finished (or the grace period ran out)


@dataclass(frozen=True)
class ServiceContext:
    """What ``build`` gets: its parsed flags, the registry for its own metrics, and ``fail(reason)``: the
    service cannot go on (its engine died), so it stops serving now and its process exits non-zero (safe
    to call from any thread)."""

    name: str
    args: argparse.Namespace
    registry: CollectorRegistry
    fail: Callable[[str], None]


Build = Callable[[ServiceContext], ServiceDef]


class Runtime:
    def __init__(
        self,
        name: str,
        build: Build,
        args: argparse.Namespace | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = 0,
        grace_seconds: float = 30.0,
        tls: TlsFiles | None = None,
    ) -> None:
        self.name = name
        self._tls = tls
        self._build = build
        self._args = args or argparse.Namespace()
        self._host = host
        self._requested_port = port
        self._requested_metrics_port = metrics_port
        self.grace_seconds = grace_seconds
        self.port = 0  # bound ports, known after start()
        self.metrics_port: int | None = None
        self.ready = False
        self._server: grpc.aio.Server | None = None
        self._metrics: MetricsServer | None = None
        self._service: ServiceDef | None = None
        self._health: Health | None = None
        self._stopping: asyncio.Future[None] | None = None
        # Set by ``fail``: why the service cannot go on (an entry point then stops and exits non-zero).
        self.failure: str | None = None
        self.failed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Serve; returns once the service is ready. On failure everything started is torn down."""
        try:
            await self._start()
        except BaseException:
            await self._teardown()
            raise

    async def _start(self) -> None:
        registry = new_registry()
        self._loop = asyncio.get_running_loop()
        self._service = service = self._build(ServiceContext(self.name, self._args, registry, self.fail))
        names = [s.descriptor.full_name for s in service.services]
        # A service only the public calls (the gateway's client API) serves in plaintext behind its API keys
        # and ingress, like its HTTP port; every other one is mutual TLS when given certificates.
        mtls = self._tls is not None and not all(is_public(n) for n in names)
        interceptor = ServerInterceptor(names, RpcMetrics(registry), lambda: self.ready, authorize=mtls)
        self._server = server = grpc.aio.server(interceptors=[interceptor], options=SERVER_OPTIONS)
        for s in service.services:
            s.add_to_server(s.servicer, server)
        self._health = Health(names)
        self._health.add_to_server(server)
        await self._health.set_serving(False)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        address = f"{self._host}:{self._requested_port}"
        if mtls:
            assert self._tls is not None
            self.port = server.add_secure_port(address, server_credentials(self._tls))
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        if self._requested_metrics_port is not None:
            self._metrics = MetricsServer(self._host, self._requested_metrics_port, registry, self._serving)
            self.metrics_port = self._metrics.port
        log.info(
            "listening", service=self.name, host=self._host, port=self.port, metrics_port=self.metrics_port, mtls=mtls
        )
        if service.start is not None:
            await service.start()
        self.ready = True
        await self._health.set_serving(True)
        log.info("serving", service=self.name, port=self.port)

    def _serving(self) -> bool:
        return self.ready and self._health is not None and self._health.serving

    def fail(self, reason: str) -> None:
        """The service cannot go on: refuse new calls now and set ``failed`` (from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._failed, reason)

    def _failed(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self.ready = False  # the interceptor answers UNAVAILABLE from now on
            log.error("service failed: it stops serving and exits", service=self.name, reason=reason)
            self.failed.set()

    def servicer_of(self, full_name: str) -> object:
        """The servicer registered for ``full_name`` (e.g. "kvmesh.api.decode.v1.DecodeService"),
        so in-process tests can look at a service's state."""
        for svc in self._service.services:
            if svc.descriptor.full_name == full_name:
                return svc.servicer
        raise KeyError(full_name)

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Drain and stop (see the module docstring). Concurrent and repeated calls share one shutdown."""
        if self._stopping is None:
            grace = self.grace_seconds if grace_seconds is None else grace_seconds
            self._stopping = asyncio.ensure_future(self._stop(grace))
        # Shielded: a caller that gives up waiting does not abort the drain halfway.
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        if self._server is None:  # never started, or start failed and tore down
            return
        assert self._health is not None and self._service is not None
        log.info("draining", service=self.name, grace_seconds=grace)
        await self._health.drain()
        if self._service.drain is not None:
            await self._run_hook("drain", self._service.drain)
        await self._server.stop(grace)
        self._server = None
        if self._service.stop is not None:
            await self._run_hook("stop", self._service.stop)
        await self._teardown()
        log.info("stopped", service=self.name)

    async def _run_hook(self, name: str, hook: Hook) -> None:
        # A failing hook must not keep the rest of shutdown from running.
        try:
            await hook()
        except Exception:
            log.exception("shutdown hook failed", service=self.name, hook=name)

    async def _teardown(self) -> None:
        self.ready = False
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        if self._metrics is not None:
            # Blocks up to the HTTP server's 0.5 s poll interval: off the event loop.
            await asyncio.to_thread(self._metrics.close)
            self._metrics = None


@asynccontextmanager
async def serve(
    name: str,
    build: Build,
    args: argparse.Namespace | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = 0,
    grace_seconds: float = 5.0,
    tls: TlsFiles | None = None,
) -> AsyncIterator[Runtime]:
    """Run a service in this process for the block (tests): ``async with serve(...) as rt: rt.port``.

    Ports default to free ones on 127.0.0.1; ``metrics_port=None`` skips /metrics.
    """
    runtime = Runtime(
        name, build, args, host=host, port=port, metrics_port=metrics_port, grace_seconds=grace_seconds, tls=tls
    )
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()
