"""The real worker-side client (``kvmesh.worker.RouterLink``) against the real router service.

The two sides of the registration and KV-event protocol must agree: a decode
worker's link registers, resyncs, publishes and recovers from a gap; the
kvstore's link (no layout, KVSTORE role) feeds the cluster-wide tier; and a
real engine's block names are exactly the router's hashes of the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path

import pytest

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.worker import RouterLink
from services.router.server import RouterServicer
from tests.router.service_helpers import (
    GPU,
    KVSTORE_TIER,
    LAYOUT,
    Worker,
    names,
    prompt,
    route_tokens,
    router_service,
    stub_for,
)
from tests.router.test_router_service_outage import FAST_PROBE
from tests.worker.polling import until


class Cache:
    """A worker's block set: it changes, then publishes the event, as the engine does."""

    def __init__(self, tier: int = GPU) -> None:
        self.tier = tier
        self.blocks: set[bytes] = set()
        self.lock = threading.Lock()
        self.link: RouterLink | None = None

    def store(self, new: list[bytes]) -> None:
        with self.lock:
            self.blocks.update(new)
            if self.link is not None:
                self.link.publish("stored", new, self.tier)

    def snapshot(self) -> dict[int, list[bytes]]:
        with self.lock:
            return {self.tier: list(self.blocks)}


def link_for(port: int, cache: Cache, worker_id: str, role: int) -> RouterLink:
    engine_like = role != worker_pb2.WORKER_ROLE_KVSTORE
    link = RouterLink(
        f"127.0.0.1:{port}",
        worker_id=worker_id,
        role=role,
        address=f"{worker_id}.local:7000",
        layout=LAYOUT if engine_like else None,
        capacity=router_pb2.WorkerCapacity(total_kv_blocks=1000) if engine_like else None,
        model="tiny" if engine_like else "",
        load_fn=lambda: worker_pb2.WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000),
        snapshot_fn=cache.snapshot,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
    )
    cache.link = link
    return link


async def indexed(stub, worker_id: str) -> int:
    workers = (await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers
    return next((w.indexed_blocks for w in workers if w.endpoint.worker_id == worker_id), -1)


async def test_a_decode_link_registers_publishes_and_recovers_from_a_gap(redis_server) -> None:
    async with router_service(redis_server.url) as rt, stub_for(rt) as stub:
        router = rt.servicer_of("kvmesh.api.router.v1.RouterService")
        assert isinstance(router, RouterServicer)
        tokens = prompt(64)
        chain = names(tokens)
        cache = Cache()
        cache.store(chain[:8])  # held before the link starts: the first snapshot carries them
        link = link_for(rt.port, cache, "d1", worker_pb2.WORKER_ROLE_DECODE)
        await link.start()
        try:
            await until(lambda: link.counters.get("resyncs", 0) == 1, "the first snapshot")
            for i in range(8, 32, 8):
                cache.store(chain[i : i + 8])
                await until(lambda: link.counters.get("events_published", 0) == i, "a batch")
            assert await indexed(stub, "d1") == 32
            assert (await stub.Route(route_tokens(tokens))).decode_matched_blocks == 32

            # Batches were lost on the way: the router's sequence falls behind the link's.
            await router.router.index.set_last_seq("d1", 0)
            cache.store(chain[32:])
            await until(lambda: link.counters.get("resyncs", 0) == 2, "the resync after the gap")
            await until(lambda: link.counters.get("events_pending", 1) == 0, "the batch after the resync")
            for _ in range(100):
                if await indexed(stub, "d1") == 64:
                    break
                await asyncio.sleep(0.02)
            plan = await stub.Route(route_tokens(tokens))
            assert plan.decode_worker.worker_id == "d1" and plan.decode_matched_blocks == 64
            assert link.counters["resyncs_requested"] == 1
            assert router.router.counters["resyncs_completed"] == 2
        finally:
            await link.stop()
        # Stopping deregisters: the router forgets the worker at once.
        assert await indexed(stub, "d1") == -1


async def test_the_kvstores_link_feeds_the_cluster_tier(redis_server) -> None:
    async with router_service(redis_server.url) as rt, stub_for(rt) as stub:
        tokens = prompt(64)
        store = Cache(tier=KVSTORE_TIER)
        store.store(names(tokens)[:24])
        link = link_for(rt.port, store, "kvstore@x", worker_pb2.WORKER_ROLE_KVSTORE)
        await link.start()
        try:
            await until(lambda: link.counters.get("resyncs", 0) == 1, "the kvstore's snapshot")
            await Worker(stub, "d1").register()
            plan = await stub.Route(route_tokens(tokens))
            assert plan.decode_worker.worker_id == "d1" and plan.kvstore_matched_blocks == 24
            store.store(names(tokens)[24:40])
            await until(lambda: link.counters.get("events_published", 0) == 16, "the kvstore's events")
            assert (await stub.Route(route_tokens(tokens))).kvstore_matched_blocks == 40
        finally:
            await link.stop()


async def test_an_idle_link_is_resynced_when_redis_comes_back_empty(redis_server) -> None:
    """No events to publish: the heartbeat is what tells the link its entries are gone."""
    async with router_service(redis_server.url, "--lease-ttl-ms", "900", *FAST_PROBE) as rt, stub_for(rt) as stub:
        tokens = prompt(16)
        cache = Cache()
        cache.store(names(tokens))
        link = link_for(rt.port, cache, "d1", worker_pb2.WORKER_ROLE_DECODE)
        await link.start()
        try:
            await until(lambda: link.counters.get("resyncs", 0) == 1, "the first snapshot")
            redis_server.stop()
            plan = await stub.Route(route_tokens(tokens))
            assert not plan.index_available and plan.decode_worker.worker_id == "d1"

            redis_server.start()  # empty: the index and the sequence are gone
            await until(lambda: link.counters.get("resyncs", 0) == 2, "a resync asked by a heartbeat")
            plan = await stub.Route(route_tokens(tokens))
            assert plan.index_available and plan.decode_matched_blocks == 16
            assert link.counters["registrations"] == 1  # the lease outlived the outage
        finally:
            await link.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tests.engine.conftest import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama-gqa")


async def test_the_routers_hashes_are_the_engines_block_names(redis_server, checkpoint) -> None:
    """A real engine caches a salted prompt; the router, hashing the same tokens, finds it all."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.sampling import SamplingParams
    from kvmesh.worker.engine_link import attach_router

    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", block_size=16, num_blocks=32, max_num_seqs=2))
    tokens = list(range(1, 1 + 3 * 16 + 7))  # three full blocks and a partial one
    salt = b"tenant-a"
    engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=1), cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.blocks.hash_to_block) == 3

    async with router_service(redis_server.url) as rt, stub_for(rt) as stub:
        args = argparse.Namespace(router_address=f"127.0.0.1:{rt.port}", worker_id="d1", model="tiny")
        link = await attach_router(args, engine, worker_pb2.WORKER_ROLE_DECODE, "127.0.0.1:7000", "decode")
        assert link is not None
        try:
            await until(lambda: link.counters.get("resyncs", 0) == 1, "the engine's snapshot")
            plan = await stub.Route(route_tokens(tokens, salt))
            assert plan.total_blocks == 3 and plan.decode_matched_blocks == 3
            assert (await stub.Route(route_tokens(tokens, b"tenant-b"))).decode_matched_blocks == 0
            layout = (await stub.ListWorkers(router_pb2.ListWorkersRequest())).cluster_layout
            assert layout == kv_pb2.KVLayout(**engine.kv_layout())
        finally:
            await link.stop()
