"""The kvstore service's entry point: ``python -m services.kvstore.main``.

Health turns SERVING once the store is open, i.e. once the disk tier's
existing files are indexed (a startup scan that can take a while on a big
directory, run off the event loop). With ``--router-address`` the kvstore
registers with the router as a ``WORKER_ROLE_KVSTORE`` worker and publishes the
blocks it stores and removes (tier ``KV_TIER_KVSTORE``), so routing counts
kvstore hits; without it the store simply serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.chunking import DEFAULT_CHUNK_BYTES
from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from kvmesh.runtime.advertise import advertised_address
from kvmesh.runtime.counters import CountersCollector
from kvmesh.worker import RouterLink, register_link_metrics
from kvmesh.worker.kv_transport import KV_TRANSPORT_FLAGS, load_transport
from services.kvstore.core import KvStore
from services.kvstore.nixl_arena import NixlArena
from services.kvstore.server import KVStoreServicer

FLAGS = [
    Flag("--ram-budget-bytes", "RAM tier budget (payload bytes)", default=8 << 30, type=int),
    Flag("--disk-dir", "disk tier directory, kept across restarts (unset: RAM only)"),
    Flag("--disk-budget-bytes", "disk tier budget (payload bytes), with --disk-dir", default=64 << 30, type=int),
    Flag(
        "--chunk-bytes",
        "data per Get chunk when the client asks for no size (at most 1 MiB)",
        default=DEFAULT_CHUNK_BYTES,
        type=int,
    ),
    Flag("--router-address", "router host:port to publish the stored blocks to (unset: do not publish)"),
    Flag("--worker-id", "id to register with the router (default: kvstore@<advertise address>)"),
    Flag("--advertise-address", "host:port others reach this kvstore at (default: --host:--port)"),
    KV_TRANSPORT_FLAGS[0],
    Flag(
        "--nixl-arena-bytes",
        "NIXL arena the blocks of PutNixl/GetNixl pass through (its slots take the first worker's block size)",
        default=256 << 20,
        type=int,
    ),
]


class StoreMetrics(Collector):
    """The store's tiers and counters, read at scrape time (nothing before the store is open)."""

    def __init__(self, servicer: KVStoreServicer) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        if not self._servicer.attached:
            return
        stats = self._servicer.store.stats()
        tiers = {"ram": stats.ram, **({"disk": stats.disk} if stats.disk is not None else {})}
        blocks = GaugeMetricFamily("kvmesh_kvstore_blocks", "Blocks held, per tier.", labels=["tier"])
        used = GaugeMetricFamily("kvmesh_kvstore_bytes", "Payload bytes held, per tier.", labels=["tier"])
        budget = GaugeMetricFamily("kvmesh_kvstore_budget_bytes", "Payload byte budget, per tier.", labels=["tier"])
        evictions = CounterMetricFamily(
            "kvmesh_kvstore_evictions", "Blocks evicted to make room, per tier.", labels=["tier"]
        )
        for name, tier in tiers.items():
            blocks.add_metric([name], tier.blocks)
            used.add_metric([name], tier.bytes)
            budget.add_metric([name], tier.budget_bytes)
            evictions.add_metric([name], tier.evictions)
        hits = CounterMetricFamily("kvmesh_kvstore_hits", "Blocks served, by the tier they came from.", labels=["tier"])
        hits.add_metric(["ram"], stats.hits_ram)
        if stats.disk is not None:
            hits.add_metric(["disk"], stats.hits_disk)
        yield from (blocks, used, budget, evictions, hits)
        yield CounterMetricFamily("kvmesh_kvstore_misses", "Blocks asked for and not held.", value=stats.misses)
        yield CounterMetricFamily(
            "kvmesh_kvstore_corrupt_blocks",
            "Blocks found corrupt (checksum, truncation) and removed, startup scan included.",
            value=stats.corrupt_detected,
        )
        yield CounterMetricFamily(
            "kvmesh_kvstore_disk_write_errors",
            "Write-throughs to disk that failed (those blocks live in RAM only).",
            value=stats.disk_write_errors,
        )


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    servicer = KVStoreServicer(args.chunk_bytes)
    state: dict = {}
    ctx.registry.register(StoreMetrics(servicer))
    link: RouterLink | None = None
    if args.router_address:
        address = advertised_address(args.host, args.port, args.advertise_address)
        link = RouterLink(
            args.router_address,
            worker_id=args.worker_id or f"kvstore@{address}",
            role=worker_pb2.WORKER_ROLE_KVSTORE,
            address=address,
            layout=None,  # the kvstore holds opaque blocks of any layout
            capacity=None,  # never chosen to run a request
            model="",
            load_fn=worker_pb2.WorkerLoad,  # nothing a routing decision weighs
            snapshot_fn=lambda: {kv_pb2.KV_TIER_KVSTORE: servicer.store.hashes()},
        )
        register_link_metrics(link, ctx.registry)

    def on_event(kind: str, hashes: list[bytes]) -> None:
        if link is not None:
            link.publish(kind, hashes, kv_pb2.KV_TIER_KVSTORE)

    async def start() -> None:
        disk_budget = args.disk_budget_bytes if args.disk_dir else None
        store = await asyncio.to_thread(KvStore, args.ram_budget_bytes, args.disk_dir, disk_budget, on_event)
        nixl = load_transport(args)
        if nixl is not None:
            arena = state["arena"] = NixlArena(nixl, args.nixl_arena_bytes, store)
            ctx.registry.register(
                CountersCollector(
                    "kvmesh_kvstore_nixl",
                    lambda: arena.counters,
                    lambda: {"arena_slots_in_use": (arena.slots_in_use, "NIXL arena slots a transfer holds.")},
                )
            )
        servicer.attach(store, state.get("arena"))
        if link is not None:
            await link.start()

    async def drain() -> None:
        if link is not None:
            await link.stop()

    async def stop() -> None:
        if "arena" in state:
            await state["arena"].close()

    return ServiceDef(
        services=[GrpcService.of(kvstore_pb2, kvstore_pb2_grpc, "KVStoreService", servicer)],
        start=start,
        drain=drain,
        stop=stop,
    )


def main() -> None:
    run("kvstore", build, flags=FLAGS, default_port=50055, default_metrics_port=9105)


if __name__ == "__main__":
    main()
