"""The router service when Redis goes away: it routes on load alone, says so, and rebuilds.

Redis is a real ``redis-server`` killed and restarted (empty) on the same port.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.router.v1 import router_pb2
from tests.router.service_helpers import (
    GPU,
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

# Probe a down Redis often, so recovery shows within a few polls.
FAST_PROBE = ("--redis-probe-interval-ms", "50", "--redis-timeout-ms", "200")


async def until_heartbeat_says_resync(worker: Worker, polls: int = 400) -> None:
    """Heartbeat (which probes Redis) until the router asks this worker for a snapshot."""
    for _ in range(polls):
        resp = await worker.heartbeat()
        assert not resp.reregister_required  # the lease survived the outage
        if resp.resync_required:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{worker.worker_id} was never asked to resync")


async def test_redis_killed_mid_test_then_back(redis_server) -> None:
    async with router_service(redis_server.url, *FAST_PROBE) as rt, stub_for(rt) as stub:
        hot, cold, p1 = Worker(stub, "hot"), Worker(stub, "cold"), Worker(stub, "p1", PREFILL)
        for w in (hot, cold, p1):
            await w.register()
        tokens = prompt(64)
        chain = names(tokens)
        await hot.publish(chain)
        plan = await stub.Route(route_tokens(tokens))
        assert plan.decode_worker.worker_id == "hot" and plan.index_available

        redis_server.stop()
        # The cache holder is busy: without the index, load alone decides.
        # Busy *as a decode worker*: this 1029-token prompt is over the local-prefill
        # threshold, so p1 prefills it and the decode pick weighs running sequences
        # (and KV pressure), not tokens_in_flight. With tokens_in_flight alone, hot
        # and cold tie and the round-robin tie-break follows the registry's order,
        # which after any pull is Redis's hash order (random per redis-server):
        # "hot" won whenever a pull had reordered the registry to [cold, hot].
        await hot.heartbeat(tokens_in_flight=50_000, active_sequences=8)
        plan = await stub.Route(route_tokens(tokens))
        assert not plan.index_available
        assert plan.decode_worker.worker_id == "cold" and plan.decode_matched_blocks == 0
        assert metric(rt, "kvmesh_router_redis_available") == 0
        assert metric(rt, 'kvmesh_router_core_events_total{event="routes_load_only"}') >= 1
        # Events cannot be applied, and a snapshot cannot be taken, until Redis is back.
        lost = await hot.publish(chain[:1])
        assert lost.resync_required and not lost.accepted and lost.expected_sequence == 0
        down = await rpc_error(hot.resync({GPU: chain}, seq=1))
        assert down.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in down.details()
        listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
        assert not listed.index_available and len(listed.workers) == 3
        # Registrations go on meanwhile (kept locally, written back later).
        late = Worker(stub, "late")
        await late.register()

        redis_server.start()  # same port, empty: the index is gone
        await until_heartbeat_says_resync(hot)
        assert metric(rt, "kvmesh_router_redis_available") == 1
        assert metric(rt, "kvmesh_router_workers_awaiting_resync") == 4
        # The router says so on the next PublishKVEvents too.
        again = await hot.publish(chain[:1], seq=2)
        assert again.resync_required

        await hot.heartbeat()  # idle again
        for w, blocks in ((hot, chain), (cold, []), (p1, []), (late, chain[:8])):
            done = await w.resync({GPU: blocks}, seq=w.next_seq - 1)
            assert done.indexed_blocks == len(blocks)
            assert not (await w.heartbeat()).resync_required
        assert metric(rt, "kvmesh_router_workers_awaiting_resync") == 0
        assert (await hot.publish(chain[:1])).accepted
        plan = await stub.Route(route_tokens(tokens))
        assert plan.index_available and plan.decode_worker.worker_id == "hot"
        assert plan.decode_matched_blocks == 64
        listed = await stub.ListWorkers(router_pb2.ListWorkersRequest())
        assert listed.index_available
        assert {w.endpoint.worker_id: w.indexed_blocks for w in listed.workers} == {
            "hot": 64,
            "cold": 0,
            "p1": 0,
            "late": 8,
        }


async def test_the_router_starts_without_redis_and_catches_up(redis_server) -> None:
    redis_server.stop()
    async with router_service(redis_server.url, "--redis-wait-ms", "100", *FAST_PROBE) as rt, stub_for(rt) as stub:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert metric(rt, "kvmesh_router_redis_available") == 0

        d1 = Worker(stub, "d1")
        await d1.register()
        tokens = prompt(8)
        plan = await stub.Route(route_tokens(tokens))
        assert plan.decode_worker.worker_id == "d1" and not plan.index_available
        assert (await d1.publish(names(tokens))).resync_required

        redis_server.start()
        await until_heartbeat_says_resync(d1)
        await d1.resync({GPU: names(tokens)}, seq=0)
        plan = await stub.Route(route_tokens(tokens))
        assert plan.index_available and plan.decode_matched_blocks == 8
        # The cluster layout and the registration were written back to the new Redis.
        async with router_service(redis_server.url) as replica, stub_for(replica) as other:
            listed = await other.ListWorkers(router_pb2.ListWorkersRequest())
            assert [w.endpoint.worker_id for w in listed.workers] == ["d1"]
            assert listed.cluster_layout.block_size == 16
