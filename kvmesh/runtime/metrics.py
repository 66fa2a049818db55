"""Prometheus metrics: one registry per service, served over HTTP on its own port, beside ``/healthz``.

A registry per service (not the process-global default) lets tests run several
services in one process without duplicate-registration errors; a service adds
its own metrics to ``ServiceContext.registry``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvmesh.runtime.gpu import gpu_stats

# RPCs range from sub-millisecond (Lookup, Heartbeat) to minutes (a long
# Decode stream).
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class RpcMetrics:
    """What the server interceptor records for every RPC."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["service", "method"]
        self.requests = Counter(
            "kvmesh_rpc_requests", "RPCs finished, by final status code.", [*labels, "code"], registry=registry
        )
        self.duration = Histogram(
            "kvmesh_rpc_duration_seconds",
            "RPC duration, start to final status (whole stream for streaming RPCs).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge("kvmesh_rpc_in_flight", "RPCs being handled.", labels, registry=registry)


class GpuCollector(Collector):
    """GPU gauges read at scrape time; yields nothing on a machine without GPUs."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = gpu_stats()
        if not stats:
            return
        used = GaugeMetricFamily("kvmesh_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"])
        total = GaugeMetricFamily("kvmesh_gpu_memory_total_bytes", "GPU memory.", labels=["gpu"])
        util = GaugeMetricFamily("kvmesh_gpu_utilization_percent", "GPU busy percent.", labels=["gpu"])
        for s in stats:
            used.add_metric([str(s.index)], s.memory_used_bytes)
            total.add_metric([str(s.index)], s.memory_total_bytes)
            util.add_metric([str(s.index)], s.utilization_percent)
        yield from (used, total, util)


def new_registry() -> CollectorRegistry:
    """A service's registry, with process (CPU, memory, fds) and GPU metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(GpuCollector())
    return registry


WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def _with_healthz(metrics: WsgiApp, is_ready: Callable[[], bool]) -> WsgiApp:
    """``/healthz``: 200 while the service serves, 503 otherwise. A probe that cannot speak mutual TLS
    (Kubernetes' own gRPC probe) asks here instead of the gRPC health service."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            return metrics(environ, start_response)
        ready = is_ready()
        start_response("200 OK" if ready else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [b"SERVING\n" if ready else b"NOT_SERVING\n"]

    return app


class MetricsServer:
    """The /metrics and /healthz HTTP endpoints (prometheus_client's server, on its own thread)."""

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, is_ready: Callable[[], bool] = lambda: True
    ) -> None:
        self._httpd: WSGIServer
        self._thread: threading.Thread
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self._httpd.set_app(_with_healthz(self._httpd.get_app(), is_ready))
        self.port: int = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
