"""The HTTP API's server, living in the gateway's event loop beside grpc.aio and following the runtime's lifecycle.

start: bind and serve (a port in use fails the gateway's start-up).
drain: /health turns 503 and new generations are refused; the listening
socket closes and in-flight requests get up to the grace period to finish,
at the same time as the gRPC server's own drain.
stop: wait for that drain; requests still running then are cancelled (which
cancels them in the mesh).

Handler cancellation is on: when a client disconnects, aiohttp cancels its
handler's task, and with it the request in the mesh, even while no byte is
being written (a long prefill, a non-streamed completion).
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from services.gateway.http_app import HttpApi

log = structlog.get_logger("kvmesh.gateway.http")


class HttpServer:
    def __init__(self, api: HttpApi, host: str, port: int, grace_seconds: float) -> None:
        self._api = api
        self._host = host
        self._requested_port = port
        self._runner = web.AppRunner(
            api.app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_seconds
        )
        self._shutdown: asyncio.Future[None] | None = None
        self.port = 0  # bound, known after start()

    async def start(self) -> None:
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, self._host, self._requested_port)
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.port = self._runner.addresses[0][1]
        log.info("http listening", host=self._host, port=self.port)

    async def drain(self) -> None:
        self._api.draining = True
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._runner.cleanup())

    async def stop(self) -> None:
        await self.drain()
        await self._shutdown
        log.info("http stopped")
