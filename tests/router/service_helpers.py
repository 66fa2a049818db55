"""The router service in-process over a real Redis, and workers played through its stub: what the router's
gRPC tests share (``test_router_service_grpc``, ``_link``, ``_outage``, the kvstore's)."""

from __future__ import annotations

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
