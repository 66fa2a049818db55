"""The router service over gRPC, started in-process with its real ``build`` over a real Redis.

Workers here are played by the test through the RouterService stub; the real
worker-side client (``RouterLink``) is in ``test_router_service_link.py`` and
Redis outages in ``test_router_service_outage.py``. The helpers at the top are
shared with both.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import grpc
import pytest

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.blocks import block_hashes
from kvmesh.runtime import Runtime, common_flags, parse_flags, serve
from services.router.main import FLAGS, build

BLOCK_SIZE = 16
FINGERPRINT = bytes(range(16))
LAYOUT = kv_pb2.KVLayout(
    block_size=BLOCK_SIZE,
    dtype="bfloat16",
    layout="layers,kv,block_tokens,kv_heads,head_dim",
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    model_fingerprint=FINGERPRINT,
)
GPU, KVSTORE_TIER = kv_pb2.KV_TIER_GPU, kv_pb2.KV_TIER_KVSTORE
PREFILL, DECODE = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE
KVSTORE = worker_pb2.WORKER_ROLE_KVSTORE
STORED = router_pb2.KV_EVENT_TYPE_STORED


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    """A prompt of n full blocks (plus 5 tokens of a partial one, which has no name)."""
    return list(range(start, start + n_blocks * BLOCK_SIZE + 5))


def names(tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
    """The blocks' names as every engine of the cluster computes them."""
    return block_hashes(tokens, BLOCK_SIZE, FINGERPRINT, salt)


@asynccontextmanager
async def router_service(redis_url: str, *argv: str) -> AsyncIterator[Runtime]:
    """The router in this process on free ports, its flags parsed as ``main`` parses them."""
    args = parse_flags("router", [*common_flags(0, 0), *FLAGS], ["--redis-url", redis_url, *argv], environ={})
    async with serve("router", build, args, metrics_port=0, grace_seconds=1.0) as rt:
        yield rt


@asynccontextmanager
async def stub_for(rt: Runtime) -> AsyncIterator[router_pb2_grpc.RouterServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


def metrics_text(rt: Runtime) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{rt.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(rt: Runtime, sample: str, default: float | None = None) -> float:
    """The value of one sample, named with its labels; ``default`` if it is not exported (yet)."""
    values = [ln.rsplit(" ", 1)[1] for ln in metrics_text(rt).splitlines() if ln.startswith(sample + " ")]
    if not values and default is not None:
        return default
    [value] = values
    return float(value)


class Worker:
    """One worker played through the stub: registers, heartbeats, publishes numbered batches."""

    def __init__(self, stub, worker_id: str, role: int = DECODE, layout=LAYOUT) -> None:
        self.stub = stub
        self.worker_id = worker_id
        self.role = role
        self.layout = layout
        self.lease_id = ""
        self.next_seq = 1

    async def register(self) -> router_pb2.RegisterWorkerResponse:
        resp = await self.stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(
                worker_id=self.worker_id,
                role=self.role,
                address=f"{self.worker_id}.local:7000",
                layout=self.layout,
                capacity=router_pb2.WorkerCapacity(total_kv_blocks=10_000, max_num_seqs=8)
                if self.role != KVSTORE
                else None,
                model="tiny",
            )
        )
        self.lease_id, self.next_seq = resp.lease_id, resp.expected_sequence
        await self.heartbeat()
        return resp

    async def heartbeat(self, **load) -> router_pb2.HeartbeatResponse:
        load = {"free_kv_blocks": 10_000, "total_kv_blocks": 10_000, **load}
        return await self.stub.Heartbeat(
            router_pb2.HeartbeatRequest(
                worker_id=self.worker_id, lease_id=self.lease_id, load=worker_pb2.WorkerLoad(**load)
            )
        )

    async def publish(self, hashes: Sequence[bytes], tier: int = GPU, seq: int | None = None):
        seq = self.next_seq if seq is None else seq
        resp = await self.stub.PublishKVEvents(
            router_pb2.PublishKVEventsRequest(
                worker_id=self.worker_id,
                lease_id=self.lease_id,
                sequence=seq,
                events=[router_pb2.KVEvent(type=STORED, block_hashes=hashes, tier=tier)],
            )
        )
        if resp.accepted:
            self.next_seq = resp.expected_sequence
        return resp

    async def resync(self, blocks: dict[int, Sequence[bytes]], seq: int, chunk: int = 1000):
        def parts():
            for tier, hashes in blocks.items():
                for i in range(0, max(len(hashes), 1), chunk):
                    yield router_pb2.ResyncWorkerRequest(
                        worker_id=self.worker_id,
                        lease_id=self.lease_id,
                        sequence=seq,
                        tier=tier,
                        block_hashes=hashes[i : i + chunk],
                    )

        resp = await self.stub.ResyncWorker(parts())
        self.next_seq = resp.expected_sequence
        return resp


def route_tokens(tokens: Sequence[int], salt: bytes = b"", exclude=()) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(
        request_id="req-1",
        tokens=router_pb2.TokenPrompt(token_ids=tokens),
        cache_salt=salt,
        max_new_tokens=32,
        exclude_worker_ids=exclude,
    )


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


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
