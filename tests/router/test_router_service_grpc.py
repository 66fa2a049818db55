"""The router service over gRPC, started in-process with its real ``build`` over a real Redis.

Workers here are played by the test through the RouterService stub; the real
worker-side client (``RouterLink``) is in ``test_router_service_link.py`` and
Redis outages in ``test_router_service_outage.py``; the helpers all three share are in
``service_helpers.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.runtime import Runtime
from tests.router.service_helpers import (
    BLOCK_SIZE,
    DECODE,
    GPU,
    KVSTORE,
    KVSTORE_TIER,
    LAYOUT,
    PREFILL,
    Worker,
    metric,
    names,
    prompt,
    route_tokens,
    router_service,
    rpc_error,
    stub_for,
)


@pytest.fixture
async def router(redis_server) -> AsyncIterator[Runtime]:
    async with router_service(redis_server.url) as rt:
        yield rt


@pytest.fixture
async def stub(router) -> AsyncIterator[router_pb2_grpc.RouterServiceStub]:
    async with stub_for(router) as s:
        yield s


async def test_route_picks_the_worker_holding_the_prefix(router, stub) -> None:
    d1, d2, p1 = Worker(stub, "d1"), Worker(stub, "d2"), Worker(stub, "p1", PREFILL)
    for w in (d1, d2, p1):
        assert (await w.register()).expected_sequence == 1
    salt = b"tenant-a"
    short = prompt(64)
    await d1.publish(names(short, salt)[:20])
    await d2.publish(names(short, salt))

    plan = await stub.Route(route_tokens(short, salt))
    assert plan.prefill_locally and not plan.HasField("prefill_worker")
    assert plan.decode_worker == worker_pb2.WorkerEndpoint(worker_id="d2", address="d2.local:7000")
    assert (plan.total_blocks, plan.decode_matched_blocks, plan.prefill_matched_blocks) == (64, 64, 64)
    assert plan.index_available and plan.kvstore_matched_blocks == 0
    assert plan.timings.total_ns >= plan.timings.compute_ns > 0

    # The same prompt hashed by the caller gets the same plan.
    hashed = router_pb2.RouteRequest(
        hashed=router_pb2.HashedPrompt(block_hashes=names(short, salt), block_size=BLOCK_SIZE, num_tokens=len(short))
    )
    again = await stub.Route(hashed)
    assert again.decode_worker.worker_id == "d2" and again.decode_matched_blocks == 64

    # Another tenant's salt names other blocks: nothing is cached for it.
    other = await stub.Route(route_tokens(short, b"tenant-b"))
    assert other.decode_matched_blocks == 0 and other.total_blocks == 64

    # A long prompt mostly held by the prefill worker is prefilled there, then shipped.
    long = prompt(400, start=10_000)
    await p1.publish(names(long, salt)[:300])
    plan = await stub.Route(route_tokens(long, salt))
    assert not plan.prefill_locally
    assert plan.prefill_worker.worker_id == "p1" and plan.prefill_matched_blocks == 300
    assert plan.decode_worker.worker_id in {"d1", "d2"} and plan.decode_matched_blocks == 0

    excluded = await stub.Route(route_tokens(short, salt, exclude=["d2"]))
    assert excluded.decode_worker.worker_id == "d1" and excluded.decode_matched_blocks == 20

    # Local: the held short prompt (twice) and d1's 20 blocks, leaving 709 tokens to compute.
    assert metric(router, 'kvmesh_router_decisions_total{outcome="prefill_locally"}') == 3
    # Shipped: the other tenant's 1,029 uncached tokens (> 1,024) and the long prompt.
    assert metric(router, 'kvmesh_router_decisions_total{outcome="disaggregated"}') == 2
    assert metric(router, 'kvmesh_router_workers{role="decode"}') == 2
    assert metric(router, 'kvmesh_router_workers{role="prefill"}') == 1
    assert metric(router, "kvmesh_router_redis_available") == 1
    assert metric(router, 'kvmesh_router_matched_blocks_count{tier="gpu"}') == 5
    assert metric(router, 'kvmesh_router_index_roundtrip_seconds_count{op="longest_prefix"}') == 5


async def test_a_layout_that_differs_from_the_clusters_is_failed_precondition(stub) -> None:
    await Worker(stub, "d1").register()
    bad = kv_pb2.KVLayout()
    bad.CopyFrom(LAYOUT)
    bad.dtype = "float16"
    err = await rpc_error(Worker(stub, "d2", layout=bad).register())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype='float16'" in err.details() and "cluster's dtype='bfloat16'" in err.details()

    listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
    assert [w.endpoint.worker_id for w in listed.workers] == ["d1"]
    assert listed.cluster_layout == LAYOUT and listed.index_available


async def test_a_block_size_other_than_the_routers_is_refused_even_first(redis_server) -> None:
    async with router_service(redis_server.url, "--block-size", "32") as rt, stub_for(rt) as stub:
        err = await rpc_error(Worker(stub, "d1").register())  # LAYOUT cuts 16-token blocks
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size=16" in err.details() and "block size 32" in err.details()
        # Refused, it did not become the cluster's layout either.
        assert not (await stub.ListWorkers(router_pb2.ListWorkersRequest())).HasField("cluster_layout")


async def test_malformed_registrations_and_events_are_invalid_argument(stub) -> None:
    no_layout = await rpc_error(Worker(stub, "d1", layout=None).register())
    assert no_layout.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV layout" in no_layout.details()
    no_role = await rpc_error(Worker(stub, "d1", role=worker_pb2.WORKER_ROLE_UNSPECIFIED).register())
    assert no_role.code() == grpc.StatusCode.INVALID_ARGUMENT

    d1 = Worker(stub, "d1")
    await d1.register()
    short_hash = await rpc_error(d1.publish([b"too short"]))
    assert short_hash.code() == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in short_hash.details()
    no_tier = await rpc_error(d1.publish(names(prompt(1)), tier=kv_pb2.KV_TIER_UNSPECIFIED))
    assert no_tier.code() == grpc.StatusCode.INVALID_ARGUMENT
    no_prompt = await rpc_error(stub.Route(router_pb2.RouteRequest()))
    assert no_prompt.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing was applied: the next batch is still the first.
    assert (await d1.publish(names(prompt(4)))).expected_sequence == 2


async def test_a_gap_asks_for_a_resync_which_puts_the_worker_back_in_sync(stub) -> None:
    d1 = Worker(stub, "d1")
    await d1.register()
    tokens = prompt(100)
    chain = names(tokens)
    assert (await d1.publish(chain[:10])).accepted

    gap = await d1.publish(chain[10:20], seq=3)  # batch 2 was lost
    assert not gap.accepted and gap.resync_required and gap.expected_sequence == 2
    plan = await stub.Route(route_tokens(tokens))
    assert plan.decode_matched_blocks == 10  # the lost batch is not in the index

    # The snapshot as of batch 3, in several messages per tier.
    done = await d1.resync({GPU: chain[:90], KVSTORE_TIER: chain[:5]}, seq=3, chunk=32)
    assert done.indexed_blocks == 95 and done.expected_sequence == 4
    assert done.timings.total_ns > 0
    assert (await d1.publish(chain[90:])).accepted
    assert (await d1.publish(chain[90:], seq=4)).accepted  # a retry: acknowledged, ignored
    assert d1.next_seq == 5
    plan = await stub.Route(route_tokens(tokens))
    assert plan.decode_matched_blocks == 100 and plan.kvstore_matched_blocks == 5

    [status] = (await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers
    assert status.indexed_blocks == 105 and status.role == DECODE


async def test_a_resync_stream_must_name_one_worker_lease_and_sequence(stub) -> None:
    d1 = Worker(stub, "d1")
    await d1.register()

    def parts():
        yield router_pb2.ResyncWorkerRequest(worker_id="d1", lease_id=d1.lease_id, sequence=3, tier=GPU)
        yield router_pb2.ResyncWorkerRequest(worker_id="d1", lease_id=d1.lease_id, sequence=4, tier=GPU)

    err = await rpc_error(stub.ResyncWorker(parts()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    stale = await rpc_error(
        stub.ResyncWorker(iter([router_pb2.ResyncWorkerRequest(worker_id="d1", lease_id="not-the-lease", sequence=0)]))
    )
    assert stale.code() == grpc.StatusCode.NOT_FOUND


async def test_lease_expiry_drops_a_silent_worker(redis_server) -> None:
    async with router_service(redis_server.url, "--lease-ttl-ms", "1000") as rt, stub_for(rt) as stub:
        silent, alive = Worker(stub, "silent"), Worker(stub, "alive")
        reg = await silent.register()
        assert (reg.lease_ttl_ms, reg.heartbeat_interval_ms) == (1000, 333)
        await alive.register()
        tokens = prompt(64)
        await silent.publish(names(tokens))

        async def keep_alive() -> None:
            while True:
                await alive.heartbeat()
                await asyncio.sleep(0.1)

        beating = asyncio.create_task(keep_alive())
        try:
            for _ in range(200):
                workers = (await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers
                if [w.endpoint.worker_id for w in workers] == ["alive"]:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the silent worker was never dropped")
            plan = await stub.Route(route_tokens(tokens))
            assert plan.decode_worker.worker_id == "alive" and plan.decode_matched_blocks == 0
            # Its index entries go with it (the sweep drops them); its lease is gone.
            for _ in range(200):
                if metric(rt, 'kvmesh_router_core_events_total{event="leases_expired"}', 0) == 1:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the lease sweep never ran")
            hb = await silent.heartbeat()
            assert hb.reregister_required
            lost = await rpc_error(silent.publish(names(tokens)))
            assert lost.code() == grpc.StatusCode.NOT_FOUND
            # Registering again starts over: no entries, sequence 1.
            assert (await silent.register()).expected_sequence == 1
            [status] = [
                w
                for w in (await stub.ListWorkers(router_pb2.ListWorkersRequest())).workers
                if w.endpoint.worker_id == "silent"
            ]
            assert status.indexed_blocks == 0
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)


async def test_the_kvstore_counts_as_the_cluster_cache_and_never_runs_a_request(router, stub) -> None:
    store = Worker(stub, "kvstore@x", role=KVSTORE, layout=None)  # no layout, no capacity
    assert (await store.register()).expected_sequence == 1
    tokens = prompt(64)
    await store.publish(names(tokens)[:40], tier=KVSTORE_TIER)
    # Alone it cannot run anything, and its (absent) layout did not become the cluster's.
    err = await rpc_error(stub.Route(route_tokens(tokens)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "prefill or decode" in err.details()
    assert not (await stub.ListWorkers(router_pb2.ListWorkersRequest())).HasField("cluster_layout")

    for w in ("d1", "d2"):
        await Worker(stub, w).register()
    for _ in range(6):
        plan = await stub.Route(route_tokens(tokens))
        assert plan.kvstore_matched_blocks == 40 and plan.total_blocks == 64
        assert plan.decode_worker.worker_id in {"d1", "d2"} and plan.decode_matched_blocks == 0
    hashed = await stub.Route(
        router_pb2.RouteRequest(hashed=router_pb2.HashedPrompt(block_hashes=names(tokens), block_size=BLOCK_SIZE))
    )
    assert hashed.kvstore_matched_blocks == 40

    [listed] = (await stub.ListWorkers(router_pb2.ListWorkersRequest(role=KVSTORE))).workers
    assert listed.endpoint.worker_id == "kvstore@x" and listed.indexed_blocks == 40
    assert metric(router, 'kvmesh_router_workers{role="kvstore"}') == 1
    assert metric(router, 'kvmesh_router_matched_blocks_sum{tier="kvstore"}') == 7 * 40


async def test_no_worker_is_unavailable_with_a_clear_message(router, stub) -> None:
    err = await rpc_error(stub.Route(route_tokens(prompt(4))))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "registered" in err.details()

    d1 = Worker(stub, "d1")
    await d1.register()
    assert (await stub.Route(route_tokens(prompt(4)))).decode_worker.worker_id == "d1"
    excluded = await rpc_error(stub.Route(route_tokens(prompt(4), exclude=["d1"])))
    assert excluded.code() == grpc.StatusCode.UNAVAILABLE

    gone = await stub.DeregisterWorker(router_pb2.DeregisterWorkerRequest(worker_id="d1", lease_id=d1.lease_id))
    assert gone.removed
    again = await stub.DeregisterWorker(router_pb2.DeregisterWorkerRequest(worker_id="d1", lease_id=d1.lease_id))
    assert not again.removed
    err = await rpc_error(stub.Route(route_tokens(prompt(4))))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert metric(router, 'kvmesh_router_decisions_total{outcome="no_worker"}') == 3


async def test_an_unknown_lease_is_told_to_register_again(stub) -> None:
    d1 = Worker(stub, "d1")
    await d1.register()
    old = d1.lease_id
    await d1.register()  # a restarted worker: the old lease is replaced
    d1.lease_id = old
    assert (await d1.heartbeat()).reregister_required
    missing = await rpc_error(stub.Heartbeat(router_pb2.HeartbeatRequest(worker_id="d1")))
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT
