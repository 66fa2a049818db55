"""The registry's logic with a fake clock: leases, heartbeats, layout agreement."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.errors import FailedPrecondition, NotFound
from services.router.registry import WorkerRegistry
from services.router.worker import Role, WorkerLoad

from .conftest import LAYOUT, FakeClock, worker


@pytest.fixture
def registry(clock) -> WorkerRegistry:
    return WorkerRegistry(lease_ttl_s=10.0, now=clock)


def test_register_gives_a_lease_and_heartbeats_renew_it(registry, clock: FakeClock):
    lease = registry.register(worker("a"))
    assert lease.expires_at == clock.t + 10 and lease.heartbeat_interval_s < lease.ttl_s
    clock.advance(8)
    load = WorkerLoad(queued_requests=2, active_sequences=3, free_kv_blocks=5, total_kv_blocks=9)
    renewed = registry.heartbeat("a", lease.lease_id, load)
    assert renewed.expires_at == clock.t + 10
    clock.advance(8)  # 16 s after registering, 8 after the heartbeat: still alive
    [state] = registry.live()
    assert state.load == load and state.heartbeat_at == clock.t - 8


def test_a_silent_worker_expires(registry, clock: FakeClock):
    lease_a = registry.register(worker("a"))
    registry.register(worker("b"))
    clock.advance(6)
    registry.heartbeat("a", lease_a.lease_id, WorkerLoad())
    clock.advance(5)
    assert [s.worker_id for s in registry.live()] == ["a"]
    assert registry.expire() == ["b"]
    with pytest.raises(NotFound):
        registry.heartbeat("b", None, WorkerLoad())


def test_first_layout_defines_the_cluster_and_a_mismatch_names_the_field(registry):
    registry.register(worker("a"))
    other = replace(LAYOUT, num_kv_heads=8)
    with pytest.raises(FailedPrecondition, match="num_kv_heads=8 .* cluster's num_kv_heads=2"):
        registry.register(worker("b", layout=other))
    with pytest.raises(FailedPrecondition, match="block_size"):
        registry.register(worker("c", layout=replace(LAYOUT, block_size=32)))
    assert [s.worker_id for s in registry.live()] == ["a"]


def test_registering_again_replaces_the_old_lease(registry):
    old = registry.register(worker("a"))
    new = registry.register(worker("a"))
    assert new.lease_id != old.lease_id
    with pytest.raises(NotFound, match="replaced"):
        registry.heartbeat("a", old.lease_id, WorkerLoad())
    registry.heartbeat("a", new.lease_id, WorkerLoad())


def test_deregister_needs_the_current_lease(registry):
    lease = registry.register(worker("a", Role.PREFILL))
    assert not registry.deregister("a", "not-the-lease")
    assert registry.deregister("a", lease.lease_id)
    assert registry.live() == []


def test_merge_adopts_the_shared_view_but_keeps_fresher_local_heartbeats(registry, clock):
    la = registry.register(worker("a"))
    registry.register(worker("b"))
    shared = {s.worker_id: s for s in registry.all_states()}
    clock.advance(1)
    registry.heartbeat("a", la.lease_id, WorkerLoad(queued_requests=7))
    # The shared view lacks "b" (another replica expired it) and has an older "a".
    registry.merge([shared["a"]])
    [a] = registry.live()
    assert a.worker_id == "a" and a.load.queued_requests == 7
