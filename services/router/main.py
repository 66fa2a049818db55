"""The router service's entry point: ``python -m services.router.main``.

The router starts whether or not Redis is up: start-up waits up to
``--redis-wait-ms`` for it, then serves either way (routing on load alone
until Redis answers). One background task sweeps lapsed leases and, through
the same core call, probes a down Redis and rebuilds the index when it is back
(the core then asks every live worker to resync).

Token prompts are hashed with ``kvmesh.blocks.block_hashes`` using
``--block-size`` and the model fingerprint of the cluster's KV layout (the
first registered worker's); a worker with another block size is refused, so
the router's hashes are exactly the names the workers' engines give their
blocks.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter as Tally
from collections.abc import Iterator
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.blocks import DEFAULT_BLOCK_SIZE
from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from services.router.core import Router
from services.router.index import PrefixIndex, RedisPrefixIndex
from services.router.policy import CacheAwarePolicy, CostWeights, RoutePlan
from services.router.redis_store import KEY_PREFIX, StoreUnavailable, connect
from services.router.registry import WorkerRegistry
from services.router.registry_store import RegistryStore
from services.router.server import RouterServicer
from services.router.worker import Role

log = structlog.get_logger("kvmesh.router")

_W = CostWeights()

FLAGS = [
    Flag("--redis-url", "Redis holding the shared prefix index and registry", default="redis://127.0.0.1:6379/0"),
    Flag("--redis-password-file", "file holding Redis's password (kvmesh certs makes one; unset: none)"),
    Flag("--redis-key-prefix", "prefix of every Redis key; replicas sharing an index use the same", default=KEY_PREFIX),
    Flag(
        "--redis-timeout-ms",
        "per Redis command attempt; past it the router routes on load alone",
        default=500,
        type=int,
    ),
    Flag(
        "--redis-wait-ms",
        "at start-up, how long to wait for Redis before serving on load alone",
        default=2000,
        type=int,
    ),
    Flag("--redis-probe-interval-ms", "while Redis is down, how often to try it again", default=1000, type=int),
    Flag(
        "--registry-pull-interval-ms",
        "how stale this replica's copy of the shared registry may get",
        default=50,
        type=int,
    ),
    Flag(
        "--lease-ttl-ms",
        "a worker silent this long is dropped from routing with its index entries",
        default=10_000,
        type=int,
    ),
    Flag(
        "--heartbeat-interval-ms",
        "how often workers are told to heartbeat (0: a third of the TTL)",
        default=0,
        type=int,
    ),
    Flag(
        "--block-size",
        "tokens per KV block, for hashing token prompts; other workers are refused",
        default=DEFAULT_BLOCK_SIZE,
        type=int,
    ),
    # Policy knobs (services/router/policy.py explains the cost model).
    Flag(
        "--local-prefill-max-uncached-tokens",
        "the decode worker prefills itself when at most this many prompt tokens are uncached there",
        default=_W.local_max_uncached_tokens,
        type=int,
    ),
    Flag(
        "--local-prefill-min-hit-fraction",
        "...or when it already holds at least this fraction of the prompt's blocks",
        default=_W.local_min_hit_fraction,
        type=float,
    ),
    Flag(
        "--recompute-cost",
        "weight of prompt tokens to compute against queued tokens",
        default=_W.recompute_cost,
        type=float,
    ),
    Flag(
        "--request-overhead-tokens",
        "fixed cost of each queued request, in tokens",
        default=_W.request_overhead_tokens,
        type=int,
    ),
    Flag(
        "--active-seq-tokens",
        "cost of each running sequence on a worker, in tokens",
        default=_W.active_seq_tokens,
        type=int,
    ),
    Flag(
        "--kvstore-fetch-cost",
        "fetching a block from the kvstore, relative to recomputing it",
        default=_W.kvstore_fetch_cost,
        type=float,
    ),
    Flag(
        "--transfer-cost",
        "moving one token's KV from the prefill to the decode worker",
        default=_W.transfer_cost,
        type=float,
    ),
    Flag(
        "--kv-shortage-cost",
        "per token of KV that would not fit in a worker's free blocks",
        default=_W.kv_shortage_cost,
        type=float,
    ),
]

_OUTCOMES = ("prefill_locally", "disaggregated", "no_worker")
_BLOCK_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096, 16384)
_INDEX_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class RouteMetrics:
    """What the servicer decided, one observation per Route call."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvmesh_router_decisions", "Route decisions, by outcome.", ["outcome"], registry=registry
        )
        for outcome in _OUTCOMES:
            self.decisions.labels(outcome)
        self.matched_blocks = Histogram(
            "kvmesh_router_matched_blocks",
            "Leading prompt blocks already held per decision: on the GPU of the worker that "
            "prefills (tier=gpu), in the kvstore (tier=kvstore).",
            ["tier"],
            buckets=_BLOCK_BUCKETS,
            registry=registry,
        )
        self.index_seconds = Histogram(
            "kvmesh_router_index_roundtrip_seconds",
            "Round trips to the Redis prefix index, by operation (longest_prefix: one per Route).",
            ["op"],
            buckets=_INDEX_BUCKETS,
            registry=registry,
        )

    def observe_route(self, plan: RoutePlan | None) -> None:
        if plan is None:
            self.decisions.labels("no_worker").inc()
            return
        self.decisions.labels("prefill_locally" if plan.prefill_locally else "disaggregated").inc()
        self.matched_blocks.labels("gpu").observe(plan.prefill_matched_blocks)
        self.matched_blocks.labels("kvstore").observe(plan.kvstore_matched_blocks)


class TimedIndex:
    """A ``PrefixIndex`` that records how long each call to the real one takes."""

    def __init__(self, index: PrefixIndex, seconds: Histogram) -> None:
        self._index = index
        self._seconds = seconds

    def __getattr__(self, name: str):
        attr = getattr(self._index, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await attr(*args, **kwargs)
            finally:
                self._seconds.labels(name).observe(time.perf_counter() - start)

        return timed


class RouterStateCollector(Collector):
    """The core's state, read at scrape time (on the metrics thread: copies only)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self._router
        roles = Tally(s.info.role for s in r.registry.all_states())
        workers = GaugeMetricFamily(
            "kvmesh_router_workers", "Workers registered (lease not yet swept), by role.", labels=["role"]
        )
        for role in Role:
            workers.add_metric([role.value], roles[role])
        yield workers
        yield GaugeMetricFamily(
            "kvmesh_router_redis_available",
            "1 while the prefix index (Redis) answers; 0 while routing on load alone.",
            value=int(r.redis_available),
        )
        yield GaugeMetricFamily(
            "kvmesh_router_workers_awaiting_resync",
            "Workers whose index entries were lost (Redis outage) and whose snapshot has not come yet.",
            value=len(r.workers_needing_resync()),
        )
        events = CounterMetricFamily(
            "kvmesh_router_core_events",
            "What the router core did: registrations, leases expired, resyncs, Redis outages and "
            "recoveries, load-only routes...",
            labels=["event"],
        )
        for name, n in sorted(dict(r.counters).items()):
            events.add_metric([name], n)
        yield events


async def wait_for_redis(router: Router, wait_s: float) -> None:
    """Wait up to ``wait_s`` for Redis, then take the shared registry (or note Redis is down)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            await router.index.ping()
            break
        except StoreUnavailable:
            if loop.time() >= deadline:
                break
            await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
    # Pulls what other replicas registered; if Redis is down, the core marks it so and logs it.
    await router.expire_leases()


async def maintain(router: Router, interval_s: float) -> None:
    """Sweep lapsed leases; the same core call probes a down Redis and rebuilds when it is back."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await router.expire_leases()
        except Exception:
            log.exception("router_maintenance_failed")


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    registry = WorkerRegistry(
        lease_ttl_s=args.lease_ttl_ms / 1000,
        heartbeat_interval_s=args.heartbeat_interval_ms / 1000 or None,
        block_size=args.block_size,
    )
    metrics = RouteMetrics(ctx.registry)
    password = Path(args.redis_password_file).read_text().strip() if args.redis_password_file else None
    client = connect(args.redis_url, timeout_s=args.redis_timeout_ms / 1000, password=password)
    index = TimedIndex(RedisPrefixIndex(client, prefix=args.redis_key_prefix), metrics.index_seconds)
    weights = CostWeights(
        local_max_uncached_tokens=args.local_prefill_max_uncached_tokens,
        local_min_hit_fraction=args.local_prefill_min_hit_fraction,
        recompute_cost=args.recompute_cost,
        request_overhead_tokens=args.request_overhead_tokens,
        active_seq_tokens=args.active_seq_tokens,
        kvstore_fetch_cost=args.kvstore_fetch_cost,
        transfer_cost=args.transfer_cost,
        kv_shortage_cost=args.kv_shortage_cost,
    )
    probe_interval_s = args.redis_probe_interval_ms / 1000
    router = Router(
        index,  # type: ignore[arg-type]  # TimedIndex forwards every PrefixIndex call
        registry,
        RegistryStore(client, prefix=args.redis_key_prefix),
        CacheAwarePolicy(weights),
        pull_interval_s=args.registry_pull_interval_ms / 1000,
        probe_interval_s=probe_interval_s,
    )
    ctx.registry.register(RouterStateCollector(router))
    servicer = RouterServicer(router, on_route=metrics.observe_route)
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        try:
            await wait_for_redis(router, args.redis_wait_ms / 1000)
        except BaseException:  # cancelled by a signal during start-up: stop is not called
            await client.aclose()
            raise
        sweep_s = min(registry.lease_ttl_s / 4, probe_interval_s)
        tasks.append(asyncio.create_task(maintain(router, sweep_s), name="router-maintenance"))
        log.info(
            "router_ready",
            redis_available=router.redis_available,
            lease_ttl_ms=args.lease_ttl_ms,
            block_size=args.block_size,
        )

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()

    return ServiceDef(
        services=[GrpcService.of(router_pb2, router_pb2_grpc, "RouterService", servicer)],
        start=start,
        stop=stop,
    )


def main() -> None:
    run("router", build, flags=FLAGS, default_port=50052, default_metrics_port=9102)


if __name__ == "__main__":
    main()
