"""The router core over a real Redis: registry, events, routing, and Redis outages."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from kvmesh.errors import FailedPrecondition, NotFound, Unavailable
from services.router.events import EventKind, KVEvent
from services.router.index import Tier
from services.router.worker import Role, WorkerLoad

from .conftest import BLOCK_SIZE, LAYOUT, chain, idle, worker

PROMPT = list(range(64 * BLOCK_SIZE))  # 64 blocks, what chain(64) names


def stored(hashes, tier=Tier.GPU) -> KVEvent:
    return KVEvent(EventKind.STORED, tier, hashes)


async def register(router, worker_id, role=Role.DECODE):
    reg = await router.register(worker(worker_id, role))
    await router.heartbeat(worker_id, reg.lease.lease_id, idle())
    return reg


async def test_routes_to_the_worker_holding_the_prompt(make_router):
    router = make_router()
    regs = {w: await register(router, w) for w in ("a", "b", "c")}
    assert all(r.expected_seq == 1 for r in regs.values())
    c = chain(64)
    await router.publish_kv_events("a", regs["a"].lease.lease_id, 1, [stored(c[:20])])
    await router.publish_kv_events("b", regs["b"].lease.lease_id, 1, [stored(c[:60])])
    plan = await router.route(PROMPT, request_id="r1")
    assert plan.decode_worker == "b" and plan.prefill_locally
    assert plan.matched_blocks == {"a": 20, "b": 60} and plan.total_blocks == 64
    assert plan.index_available
    other_tenant = await router.route(PROMPT, cache_salt=b"tenant-2")
    assert other_tenant.matched_blocks == {}
    excluded = await router.route(PROMPT, exclude={"b"})
    assert excluded.decode_worker == "a" and excluded.matched_blocks == {"a": 20}


async def test_a_burst_between_heartbeats_does_not_pile_onto_the_cache_holder(make_router):
    router = make_router()
    regs = {w: await register(router, w) for w in ("hot", "x", "y")}
    await router.publish_kv_events("hot", regs["hot"].lease.lease_id, 1, [stored(chain(64)[:48])])
    picked = Counter([(await router.route(PROMPT)).decode_worker for _ in range(30)])
    assert picked["hot"] >= 8 and picked["hot"] < 30 and len(picked) == 3


async def test_lease_expiry_drops_the_worker_and_its_index_entries(make_router, clock):
    router = make_router()
    ra = await register(router, "a")
    rb = await register(router, "b")
    c = chain(64)
    await router.publish_kv_events("a", ra.lease.lease_id, 1, [stored(c)])
    await router.publish_kv_events("b", rb.lease.lease_id, 1, [stored(c[:10])])
    clock.advance(6)
    await router.heartbeat("b", rb.lease.lease_id, idle())
    clock.advance(5)  # a: 11 s silent, past its 10 s lease
    assert await router.expire_leases() == ["a"]
    assert router.counters["leases_expired"] == 1
    assert await router.index.indexed_blocks("a") == 0
    assert await router.index.last_seq("a") is None
    plan = await router.route(PROMPT)
    assert plan.decode_worker == "b" and plan.matched_blocks == {"b": 10}
    with pytest.raises(NotFound):
        await router.heartbeat("a", ra.lease.lease_id, idle())


async def test_layout_mismatch_is_refused_on_every_replica(make_router):
    first, second = make_router(), make_router()
    await register(first, "a")
    bad = worker("b", layout=replace(LAYOUT, dtype="float16"))
    with pytest.raises(FailedPrecondition, match="dtype"):
        await second.register(bad)
    assert second.counters["registrations_refused"] == 1


async def test_replicas_share_registry_index_and_sequence(make_router):
    a_side, b_side = make_router(), make_router()
    reg = await register(a_side, "w1")
    await register(a_side, "w2")
    c = chain(64)
    await a_side.publish_kv_events("w1", reg.lease.lease_id, 1, [stored(c[:50])])
    # The next batch goes to the other replica, which knows the sequence.
    r = await b_side.publish_kv_events("w1", reg.lease.lease_id, 3, [stored(c[50:])])
    assert r.resync_required and r.expected_seq == 2
    await b_side.heartbeat("w1", reg.lease.lease_id, idle())
    plan = await b_side.route(PROMPT)
    assert plan.decode_worker == "w1" and plan.matched_blocks == {"w1": 50}
    assert {s.state.worker_id: s.indexed_blocks for s in await b_side.list_workers()} == {
        "w1": 50,
        "w2": 0,
    }
    assert await b_side.deregister("w1", reg.lease.lease_id)
    assert [s.state.worker_id for s in await a_side.list_workers()] == ["w2"]


async def test_stale_lease_cannot_publish(make_router):
    router = make_router()
    old = await register(router, "a")
    await register(router, "a")
    with pytest.raises(NotFound):
        await router.publish_kv_events("a", old.lease.lease_id, 1, [stored(chain(1))])


async def test_no_workers_is_unavailable(make_router):
    with pytest.raises(Unavailable):
        await make_router().route(PROMPT)


async def test_redis_outage_routes_on_load_then_rebuilds_the_index(make_router, redis_server, clock):
    router = make_router(probe_interval_s=1.0)
    regs = {w: await register(router, w) for w in ("a", "b")}
    c = chain(64)
    await router.publish_kv_events("a", regs["a"].lease.lease_id, 1, [stored(c)])
    assert (await router.route(PROMPT)).decode_worker == "a"

    redis_server.stop()
    busy = replace(idle(), tokens_in_flight=5_000)
    with capture_logs() as logs:
        await router.heartbeat("a", regs["a"].lease.lease_id, busy)  # kept locally
        await router.heartbeat("b", regs["b"].lease.lease_id, idle())
        plan = await router.route(PROMPT)
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "redis_unavailable" and warning["routing"] == "load_only"
    assert not router.redis_available and not plan.index_available
    assert plan.decode_worker == "b" and plan.matched_blocks == {}  # load alone
    assert router.counters["routes_load_only"] == 1 and router.counters["redis_outages"] == 1
    r = await router.publish_kv_events("a", regs["a"].lease.lease_id, 2, [stored(c)])
    assert r.resync_required
    with pytest.raises(Unavailable):
        await router.resync("a", regs["a"].lease.lease_id, 2, {Tier.GPU: c})

    redis_server.start()  # same port, empty: the index is gone
    clock.advance(1.5)
    await router.heartbeat("a", regs["a"].lease.lease_id, idle())
    assert router.redis_available and router.counters["redis_recoveries"] == 1
    assert router.workers_needing_resync() == {"a", "b"}
    r = await router.publish_kv_events("a", regs["a"].lease.lease_id, 3, [stored(c)])
    assert r.resync_required
    done = await router.resync("a", regs["a"].lease.lease_id, 3, {Tier.GPU: c})
    assert done.indexed_blocks == 64 and done.expected_seq == 4
    await router.resync("b", regs["b"].lease.lease_id, 0, {})
    assert router.workers_needing_resync() == set()
    r = await router.publish_kv_events("a", regs["a"].lease.lease_id, 4, [])
    assert r.accepted
    plan = await router.route(PROMPT)
    assert plan.index_available and plan.decode_worker == "a" and plan.matched_blocks == {"a": 64}
    # The registry was written back too: a fresh replica sees both workers.
    assert {s.state.worker_id for s in await make_router().list_workers()} == {"a", "b"}


async def test_heartbeat_with_load_reaches_the_policy(make_router):
    router = make_router()
    regs = {w: await register(router, w) for w in ("a", "b")}
    await router.heartbeat("a", regs["a"].lease.lease_id, WorkerLoad(tokens_in_flight=100_000, total_kv_blocks=1))
    assert (await router.route(PROMPT)).decode_worker == "b"


async def test_redis_restarted_unnoticed_is_restored_from_the_replica(make_router, redis_server):
    router = make_router()
    reg = await register(router, "a")
    await router.publish_kv_events("a", reg.lease.lease_id, 1, [stored(chain(64))])
    redis_server.stop()
    redis_server.start()  # nothing called meanwhile: no error was seen
    plan = await router.route(PROMPT)
    assert plan.decode_worker == "a" and plan.matched_blocks == {}
    assert router.counters["redis_state_losses"] == 1
    assert router.workers_needing_resync() == {"a"}
    assert (await router.publish_kv_events("a", reg.lease.lease_id, 2, [])).resync_required
    await router.resync("a", reg.lease.lease_id, 2, {Tier.GPU: chain(64)})
    assert (await router.route(PROMPT)).matched_blocks == {"a": 64}
