"""Shared pieces for the router tests: a fake clock, workers, chains, routers over real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from kvmesh.blocks import block_hashes
from services.router.core import Router
from services.router.index import RedisPrefixIndex
from services.router.redis_store import connect
from services.router.registry import WorkerRegistry
from services.router.registry_store import RegistryStore
from services.router.worker import KVLayout, Role, WorkerCapacity, WorkerInfo, WorkerLoad

BLOCK_SIZE = 16
FINGERPRINT = b"\x01" * 16
LAYOUT = KVLayout(
    block_size=BLOCK_SIZE,
    dtype="bfloat16",
    layout="layers,kv,block_tokens,kv_heads,head_dim",
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    model_fingerprint=FINGERPRINT,
)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def worker(worker_id: str, role: Role = Role.DECODE, layout: KVLayout = LAYOUT) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}:50051", layout, WorkerCapacity(total_kv_blocks=10_000))


def idle(total_kv_blocks: int = 10_000) -> WorkerLoad:
    return WorkerLoad(free_kv_blocks=total_kv_blocks, total_kv_blocks=total_kv_blocks)


def chain(n: int, salt: bytes = b"") -> list[bytes]:
    """The hashes of an n-block prompt (tokens 0..16n-1), as the engine names them."""
    return block_hashes(list(range(n * BLOCK_SIZE)), BLOCK_SIZE, FINGERPRINT, salt)


@pytest.fixture
async def make_router(redis_server, clock) -> AsyncIterator[Callable[..., Router]]:
    """``make_router()``: a router replica over the test's Redis; call twice for two replicas."""
    clients = []

    def make(**kwargs) -> Router:
        client = connect(redis_server.url, timeout_s=0.5)
        clients.append(client)
        return Router(
            RedisPrefixIndex(client),
            WorkerRegistry(lease_ttl_s=10.0, now=clock),
            RegistryStore(client),
            now=clock,
            pull_interval_s=0.0,
            **kwargs,
        )

    yield make
    for c in clients:
        await c.aclose()
