"""What every worker process (prefill, decode, kvstore) shares on its way to the router.

``RouterLink`` registers the worker, keeps its lease alive with heartbeats and
publishes its KV events (with per-worker sequence numbers, batching and full
resyncs), surviving router outages without ever blocking the worker.
"""

from kvmesh.worker.link_metrics import register_link_metrics
from kvmesh.worker.router_link import RouterLink, SnapshotFn

__all__ = ["RouterLink", "SnapshotFn", "register_link_metrics"]
