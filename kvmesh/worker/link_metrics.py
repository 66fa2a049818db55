"""A ``RouterLink``'s counters as Prometheus metrics, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.worker.router_link import RouterLink


class _LinkCollector(Collector):
    def __init__(self, link: RouterLink) -> None:
        self._link = link

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = self._link.counters
        pending = counters.pop("events_pending", 0)
        calls = CounterMetricFamily(
            "kvmesh_router_link_events",
            "What the worker's router link did (registrations, heartbeats, KV event batches, resyncs, failures).",
            labels=["event"],
        )
        for name, value in sorted(counters.items()):
            calls.add_metric([name], value)
        yield calls
        yield GaugeMetricFamily(
            "kvmesh_router_link_pending_events", "Block hashes queued for the router.", value=pending
        )
        yield GaugeMetricFamily(
            "kvmesh_router_link_registered",
            "1 while the worker holds a router lease.",
            value=int(self._link.registered),
        )


def register_link_metrics(link: RouterLink, registry: CollectorRegistry) -> None:
    """Export ``link.counters`` as ``kvmesh_router_link_events_total{event=...}`` and two gauges."""
    registry.register(_LinkCollector(link))
