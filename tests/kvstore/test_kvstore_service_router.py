"""The kvstore publishing its blocks to a router: the in-memory one of
tests/worker/fake_router.py for the details, then the real router over Redis.

It registers as a KVSTORE worker without a layout, sends a snapshot first
(blocks already on disk included), then STORED/REMOVED events at tier
KV_TIER_KVSTORE as blocks come, get evicted and are deleted, and deregisters
when it stops.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.runtime import serve
from tests.kvstore.test_kvstore_service_grpc import blobs, kvstore, put_stream
from tests.router.service_helpers import LAYOUT, router_service, stub_for
from tests.worker.fake_router import RouterState, build_fake_router
from tests.worker.polling import until

KVSTORE = kv_pb2.KV_TIER_KVSTORE
WORKER = "kvstore-0"


async def test_registers_and_publishes_stored_evicted_and_deleted_blocks() -> None:
    state = RouterState()
    first, second, third = blobs([1000, 1000, 1000])
    async with serve("router", build_fake_router(state), metrics_port=None) as router:
        flags = [
            "--router-address",
            f"127.0.0.1:{router.port}",
            "--worker-id",
            WORKER,
            "--advertise-address",
            "kvstore.local:50055",
            "--ram-budget-bytes",
            "2000",
        ]
        async with kvstore(*flags) as (rt, stub):
            await until(lambda: state.resyncs, "the first snapshot")
            (registration,) = state.registrations
            assert registration.role == worker_pb2.WORKER_ROLE_KVSTORE
            assert registration.address == "kvstore.local:50055"
            assert not registration.HasField("layout") and not registration.HasField("capacity")

            await stub.Put(put_stream(first.chunks() + second.chunks()))
            await until(lambda: state.blocks(WORKER, KVSTORE) == {first.block_hash, second.block_hash}, "STORED")

            await stub.Put(put_stream(third.chunks()))  # over the RAM budget: the oldest is evicted
            await until(lambda: state.blocks(WORKER, KVSTORE) == {second.block_hash, third.block_hash}, "eviction")

            await stub.Delete(kvstore_pb2.DeleteRequest(block_hashes=[second.block_hash]))
            await until(lambda: state.blocks(WORKER, KVSTORE) == {third.block_hash}, "REMOVED")

            def scrape() -> str:
                with urllib.request.urlopen(f"http://127.0.0.1:{rt.metrics_port}/metrics", timeout=5) as r:
                    return r.read().decode()

            text = await asyncio.to_thread(scrape)
            assert "kvmesh_router_link_registered 1.0" in text
            assert 'kvmesh_router_link_events_total{event="resyncs"} 1.0' in text
        assert state.deregistered == [WORKER]


async def test_a_restarted_kvstore_announces_the_blocks_on_its_disk(tmp_path: Path) -> None:
    state = RouterState()
    kept = blobs([5000, 7000])
    async with serve("router", build_fake_router(state), metrics_port=None) as router:
        flags = [
            "--router-address",
            f"127.0.0.1:{router.port}",
            "--worker-id",
            WORKER,
            "--disk-dir",
            str(tmp_path / "blocks"),
            "--disk-budget-bytes",
            str(1 << 20),
        ]
        async with kvstore(*flags) as (_, stub):
            await stub.Put(put_stream([c for blob in kept for c in blob.chunks()]))
            await until(lambda: len(state.blocks(WORKER, KVSTORE)) == 2, "the puts")
        assert state.blocks(WORKER, KVSTORE) == set()  # deregistered: the router forgot them

        async with kvstore(*flags):
            await until(lambda: len(state.resyncs) == 2, "the restarted kvstore's snapshot")
            assert state.resyncs[-1] == (WORKER, 0, 2)
            assert state.blocks(WORKER, KVSTORE) == {blob.block_hash for blob in kept}


async def test_the_kvstore_serves_while_the_router_is_down() -> None:
    (blob,) = blobs([3000])
    async with kvstore("--router-address", "127.0.0.1:1", "--worker-id", WORKER) as (_, stub):
        resp = await stub.Put(put_stream(blob.chunks()))
        assert resp.stored_blocks == 1
        lookup = await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[blob.block_hash]))
        assert lookup.num_present_prefix == 1


async def test_the_real_router_routes_on_the_kvstores_blocks(redis_server) -> None:
    chain = blobs([4000, 4000, 4000, 4000])  # one prompt's chain of 4 blocks
    hashed = router_pb2.RouteRequest(
        hashed=router_pb2.HashedPrompt(block_hashes=[b.block_hash for b in chain], block_size=16, num_tokens=64)
    )
    async with router_service(redis_server.url) as router, stub_for(router) as rstub:
        await rstub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(
                worker_id="d1",
                role=worker_pb2.WORKER_ROLE_DECODE,
                address="d1.local:1",
                layout=LAYOUT,
                capacity=router_pb2.WorkerCapacity(total_kv_blocks=100),
            )
        )
        flags = ["--router-address", f"127.0.0.1:{router.port}", "--worker-id", WORKER]
        async with kvstore(*flags) as (_, stub):
            await stub.Put(put_stream([c for blob in chain[:3] for c in blob.chunks()]))
            matched = 0
            for _ in range(500):  # the events reach the index a moment after the Put returns
                matched = (await rstub.Route(hashed)).kvstore_matched_blocks
                if matched == 3:
                    break
                await asyncio.sleep(0.02)
            assert matched == 3
            workers = (await rstub.ListWorkers(router_pb2.ListWorkersRequest())).workers
            assert {w.endpoint.worker_id: w.role for w in workers}[WORKER] == worker_pb2.WORKER_ROLE_KVSTORE
        # Stopped: deregistered, so its blocks no longer count.
        assert (await rstub.Route(hashed)).kvstore_matched_blocks == 0
