"""The core's side of what the service added: the kvstore role, the pinned block size, the
heartbeat interval. Plain core calls (no gRPC) over the shared fixtures in ``conftest``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.router.events import EventKind, KVEvent
from services.router.index import Tier
from services.router.registry import WorkerRegistry
from services.router.worker import Role

from .conftest import BLOCK_SIZE, LAYOUT, chain, idle, worker

PROMPT = list(range(64 * BLOCK_SIZE))


def kvstore(worker_id: str = "kvstore"):
    return worker(worker_id, Role.KVSTORE, layout=None)


def test_the_kvstore_has_no_layout_to_check_and_does_not_set_the_clusters(clock) -> None:
    registry = WorkerRegistry(now=clock)
    registry.register(kvstore())
    assert registry.cluster_layout is None
    registry.register(worker("d1"))
    assert registry.cluster_layout == LAYOUT
    registry.register(kvstore("kvstore-2"))  # still unchecked once the cluster has a layout
    assert {s.worker_id for s in registry.live(Role.KVSTORE)} == {"kvstore", "kvstore-2"}


def test_an_engine_worker_must_announce_its_layout(clock) -> None:
    with pytest.raises(InvalidArgument, match="layout"):
        WorkerRegistry(now=clock).register(worker("d1", layout=None))


def test_the_pinned_block_size_refuses_other_blocks_even_first(clock) -> None:
    registry = WorkerRegistry(block_size=32, now=clock)
    with pytest.raises(FailedPrecondition, match="block_size=16 .* block size 32"):
        registry.register(worker("d1"))
    assert registry.cluster_layout is None
    registry.register(worker("d2", layout=replace(LAYOUT, block_size=32)))


def test_the_heartbeat_interval_is_configurable_and_shorter_than_the_ttl(clock) -> None:
    lease = WorkerRegistry(lease_ttl_s=6.0, heartbeat_interval_s=0.5, now=clock).register(worker("a"))
    assert (lease.ttl_s, lease.heartbeat_interval_s) == (6.0, 0.5)
    assert WorkerRegistry(lease_ttl_s=6.0, now=clock).register(worker("a")).heartbeat_interval_s == 2.0
    with pytest.raises(ValueError, match="shorter"):
        WorkerRegistry(lease_ttl_s=1.0, heartbeat_interval_s=1.0)


async def test_the_router_counts_the_kvstores_blocks_and_never_picks_it(make_router) -> None:
    router = make_router()
    store = await router.register(kvstore())
    assert store.expected_seq == 1
    await router.publish_kv_events(
        "kvstore", store.lease.lease_id, 1, [KVEvent(EventKind.STORED, Tier.KVSTORE, chain(64)[:30])]
    )
    with pytest.raises(Unavailable, match="prefill or decode"):
        await router.route(PROMPT)
    for w in ("d1", "d2"):
        reg = await router.register(worker(w))
        await router.heartbeat(w, reg.lease.lease_id, idle())
    picked = set()
    for _ in range(10):
        plan = await router.route(PROMPT)
        assert plan.kvstore_matched_blocks == 30
        picked.add(plan.decode_worker)
    assert picked == {"d1", "d2"}
    # Another replica reads the kvstore's registration (no layout) back from Redis.
    roles = {s.state.worker_id: s.state.info.role for s in await make_router().list_workers()}
    assert roles == {"kvstore": Role.KVSTORE, "d1": Role.DECODE, "d2": Role.DECODE}


async def test_a_refused_first_worker_never_claims_the_shared_layout(make_router, clock) -> None:
    pinned = make_router()
    pinned.registry.block_size = 32
    with pytest.raises(FailedPrecondition):
        await pinned.register(worker("d1"))
    assert pinned.counters["registrations_refused"] == 1
    # A replica without the pin admits it as the first: nothing was claimed before.
    await make_router().register(worker("d1"))
