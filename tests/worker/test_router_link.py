"""The worker-side router client against an in-memory RouterService (tests/worker/fake_router.py).

Each test plays a worker whose cache changes state and then publishes the
event (as the engine and the kvstore do), and checks that the router's view
ends up equal to the worker's: through sequence gaps, lost leases, a router
that is down or restarts, and a queue that overflows.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Callable

import pytest

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.blocks import block_hashes
from kvmesh.runtime import Runtime, serve
from kvmesh.worker import RouterLink, SnapshotFn
from tests.worker.fake_router import RouterState, build_fake_router
from tests.worker.polling import until

GPU = kv_pb2.KV_TIER_GPU
WORKER = "decode-0"


def hashes(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(list(range((start + n) * 16)), 16, b"fingerprint")[start:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cache:
    """A worker's block cache: it changes its state, then publishes the event, under one lock."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.lock = threading.Lock()
        self.link: RouterLink | None = None

    def store(self, new: list[bytes]) -> None:
        with self.lock:
            self.blocks.update(new)
            if self.link is not None:
                self.link.publish("stored", new, GPU)

    def remove(self, gone: list[bytes]) -> None:
        with self.lock:
            self.blocks.difference_update(gone)
            if self.link is not None:
                self.link.publish("removed", gone, GPU)

    def snapshot(self) -> dict[int, list[bytes]]:
        with self.lock:
            return {GPU: list(self.blocks)}


def make_link(port: int, cache: Cache, snapshot_fn: SnapshotFn | None = None, load_fn=None, **kwargs) -> RouterLink:
    layout = kv_pb2.KVLayout(block_size=16, dtype="float32", model_fingerprint=b"f" * 16)
    link = RouterLink(
        f"127.0.0.1:{port}",
        worker_id=WORKER,
        role=worker_pb2.WORKER_ROLE_DECODE,
        address="127.0.0.1:1234",
        layout=layout,
        capacity=router_pb2.WorkerCapacity(total_kv_blocks=100),
        model="tiny",
        load_fn=load_fn or (lambda: worker_pb2.WorkerLoad(active_sequences=3, free_kv_blocks=90, total_kv_blocks=100)),
        snapshot_fn=snapshot_fn or cache.snapshot,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        **kwargs,
    )
    cache.link = link
    return link


@pytest.fixture
def state() -> RouterState:
    return RouterState()


@pytest.fixture
async def router(state: RouterState) -> AsyncIterator[Runtime]:
    async with serve("router", build_fake_router(state), metrics_port=None) as rt:
        yield rt


def in_sync(state: RouterState, cache: Cache) -> Callable[[], bool]:
    return lambda: state.blocks(WORKER, GPU) == set(cache.snapshot()[GPU]) and WORKER in state.last_seq


async def test_registers_resyncs_publishes_and_heartbeats(router: Runtime, state: RouterState) -> None:
    cache = Cache()
    cache.store(hashes(3))  # held before the link starts: the first snapshot carries them
    link = make_link(router.port, cache)
    await link.start()
    await until(lambda: state.resyncs, "the first snapshot")
    assert state.resyncs == [(WORKER, 0, 3)]
    (registration,) = state.registrations
    assert (registration.role, registration.address, registration.model) == (
        worker_pb2.WORKER_ROLE_DECODE,
        "127.0.0.1:1234",
        "tiny",
    )
    assert registration.layout.block_size == 16 and registration.capacity.total_kv_blocks == 100

    # Four engine-like threads change the cache at once; publish never waits on the router.
    chain = hashes(400, start=3)
    threads = [threading.Thread(target=lambda part=chain[i::4]: [cache.store([h]) for h in part]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.remove(chain[:50])
    await until(in_sync(state, cache), "the index to match the cache")
    assert len(state.blocks(WORKER, GPU)) == 353
    assert state.applied_sequences == list(range(1, len(state.applied_sequences) + 1))
    assert link.counters["events_published"] == 450

    await until(lambda: state.heartbeats, "a heartbeat")
    assert state.heartbeats[0].load.active_sequences == 3 and state.heartbeats[0].lease_id == state.leases[WORKER]

    await link.stop()
    assert state.deregistered == [WORKER] and not link.registered
    cache.store(hashes(1, start=500))  # after stop: dropped quietly
    assert link.counters["events_pending"] == 0


async def test_report_returns_once_the_router_has_the_changed_load(router: Runtime, state: RouterState) -> None:
    """What an adapter load waits for before it answers: a heartbeat taken after the change, acknowledged; with
    no router, False after the timeout (the worker serves on)."""
    load = worker_pb2.WorkerLoad(active_sequences=3)
    link = make_link(router.port, Cache(), load_fn=lambda: load)
    await link.start()
    try:
        await until(lambda: state.heartbeats, "a heartbeat")
        for n in (7, 8, 9):
            load = worker_pb2.WorkerLoad(active_sequences=n)
            assert await link.report()
            assert state.heartbeats[-1].load.active_sequences == n  # no waiting for the next interval
    finally:
        await link.stop()
    lonely = make_link(free_port(), Cache())
    await lonely.start()
    try:
        assert not await lonely.report(timeout_s=0.3)
    finally:
        await lonely.stop()


async def test_a_sequence_gap_resyncs_then_carries_on(router: Runtime, state: RouterState) -> None:
    cache = Cache()
    link = make_link(router.port, cache)
    await link.start()
    cache.store(hashes(10))
    await until(in_sync(state, cache), "the first events")
    state.forget_sequence(WORKER)  # the router lost this worker's state (e.g. Redis restarted)

    cache.store(hashes(5, start=10))
    cache.remove(hashes(2))
    await until(in_sync(state, cache), "the index after the resync")
    assert len(state.resyncs) == 2 and link.counters["resyncs_requested"] >= 1
    # The sequence goes on from the snapshot's.
    _, resync_seq, _ = state.resyncs[-1]
    cache.store(hashes(1, start=20))
    await until(in_sync(state, cache), "an event after the resync")
    assert state.last_seq[WORKER] > resync_seq
    await link.stop()


async def test_a_heartbeat_asking_for_a_resync_gets_one(router: Runtime, state: RouterState) -> None:
    cache = Cache()
    link = make_link(router.port, cache)
    await link.start()
    cache.store(hashes(6))
    await until(in_sync(state, cache), "the first events")
    # The blocks may reach the router in the registration's snapshot, before their events are
    # published; those events are published after it all the same: wait for them.
    await until(lambda: link.counters.get("events_published", 0) == 6, "the first events published")
    published = link.counters["batches_published"]

    state.lose_entries(WORKER)  # the index came back empty; the lease and sequence are fine
    await until(in_sync(state, cache), "the index rebuilt without any new event")
    assert len(state.resyncs) == 2 and link.counters.get("batches_published", 0) == published
    assert len(state.registrations) == 1
    await link.stop()


async def test_a_lost_lease_registers_again_and_resyncs(router: Runtime, state: RouterState) -> None:
    cache = Cache()
    link = make_link(router.port, cache)
    await link.start()
    cache.store(hashes(8))
    await until(in_sync(state, cache), "the first events")
    first_lease = state.leases[WORKER]

    state.expire(WORKER)  # e.g. a long GC pause: the router dropped the worker and its entries
    await until(lambda: len(state.registrations) == 2, "the worker to register again")
    await until(in_sync(state, cache), "the index rebuilt from the snapshot")
    assert state.leases[WORKER] != first_lease and link.counters["leases_lost"] == 1
    await link.stop()


async def test_router_down_at_start_then_up() -> None:
    port = free_port()
    cache = Cache()
    link = make_link(port, cache)
    await link.start()
    cache.store(hashes(6))  # the router is down: queued, the caller goes on
    await until(lambda: link.counters.get("register_failures", 0) >= 2, "retries against the absent router")
    assert not link.registered

    state = RouterState()
    async with serve("router", build_fake_router(state), port=port, metrics_port=None):
        await until(in_sync(state, cache), "the index once the router is up")
        cache.remove(hashes(2))
        await until(in_sync(state, cache), "an event after the outage")
        await link.stop()


async def test_router_restart_keeping_its_state_needs_no_resync() -> None:
    port, state, cache = free_port(), RouterState(), Cache()
    link = make_link(port, cache)
    async with serve("router", build_fake_router(state), port=port, metrics_port=None):
        await link.start()
        cache.store(hashes(4))
        await until(in_sync(state, cache), "the first events")
    cache.store(hashes(4, start=4))  # published while the router is down
    await until(lambda: link.counters.get("publish_failures", 0) >= 1, "a failed publish")
    async with serve("router", build_fake_router(state), port=port, metrics_port=None):
        await until(in_sync(state, cache), "the batch retried after the restart")
        # The lease survived (the state did): the same registration, no second snapshot.
        assert len(state.registrations) == 1 and len(state.resyncs) == 1
        await link.stop()


async def test_router_restart_losing_its_state_registers_again() -> None:
    port, cache = free_port(), Cache()
    link = make_link(port, cache)
    async with serve("router", build_fake_router(RouterState()), port=port, metrics_port=None):
        await link.start()
        cache.store(hashes(4))
        await until(lambda: link.counters.get("batches_published", 0) >= 1, "the first batch")
    cache.remove(hashes(1))
    fresh = RouterState()
    async with serve("router", build_fake_router(fresh), port=port, metrics_port=None):
        await until(in_sync(fresh, cache), "the index rebuilt on the new router")
        assert len(fresh.registrations) == 1 and fresh.resyncs[0][2] == 3
        await link.stop()


async def test_queue_overflow_drops_events_and_resyncs(router: Runtime, state: RouterState) -> None:
    cache = Cache()
    link = make_link(router.port, cache, max_pending_hashes=10)
    cache.store(hashes(25))  # before start: more than the queue keeps
    assert link.counters["events_dropped"] > 0
    await link.start()
    await until(in_sync(state, cache), "the index from the snapshot")
    await link.stop()


async def test_async_snapshot_and_large_snapshots_stream_in_parts(router: Runtime, state: RouterState) -> None:
    cache = Cache()
    cache.store(hashes(100))

    async def snapshot() -> dict[int, list[bytes]]:
        return cache.snapshot()

    link = make_link(router.port, cache, snapshot_fn=snapshot, resync_chunk_hashes=7)
    await link.start()
    await until(in_sync(state, cache), "the snapshot")
    assert state.resyncs == [(WORKER, 0, 100)]
    await link.stop()


def test_publish_rejects_malformed_events() -> None:
    link = make_link(free_port(), Cache())
    with pytest.raises(ValueError, match="kind"):
        link.publish("evicted", hashes(1), GPU)
    with pytest.raises(ValueError, match="16 bytes"):
        link.publish("stored", [b"short"], GPU)
    with pytest.raises(ValueError, match="tier"):
        link.publish("stored", hashes(1), kv_pb2.KV_TIER_UNSPECIFIED)
    assert link.counters["events_pending"] == 0
