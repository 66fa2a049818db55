"""gRPC health (grpc.health.v1): NOT_SERVING until the service is ready, SERVING, NOT_SERVING while draining."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

OVERALL = ""  # the empty name: the whole server, what most probes check


class Health:
    """Health for one server: the overall status and each of its services move together."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = [OVERALL, *service_names]
        self.serving = False  # what the overall status says (also served as /healthz)
        self._draining = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)
        self.serving = serving and not self._draining

    async def drain(self) -> None:
        """NOT_SERVING for good: later set_serving calls are ignored, so nothing flips it back."""
        self._draining = True
        self.serving = False
        await self.servicer.enter_graceful_shutdown()
