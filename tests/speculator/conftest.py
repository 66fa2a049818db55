"""The speculator service in-process, a hand-driven Propose stream to talk to it, and a
SpeculatorProposer connected to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.runtime import Runtime, common_flags, create_channel, parse_flags, serve
from services.speculator import main
from services.speculator.client import SpeculatorProposer
from tests.service_helpers import serve_main

# A guard against hangs, never a performance claim.
HANG_GUARD_S = 20.0
# Generous: tests check what arrives, never how fast.
BUDGET_MS = 10_000


def update(
    request_id: str, tokens: list[int], length: int, k: int = 0, deadline_us: int = 0, accepted: int = 0
) -> speculator_pb2.ProposeRequest:
    return speculator_pb2.ProposeRequest(
        context=speculator_pb2.ContextUpdate(
            request_id=request_id,
            token_ids=tokens,
            context_length=length,
            num_draft_tokens=k,
            deadline_us=deadline_us,
            accepted_draft_tokens=accepted,
        )
    )


def finished(request_id: str, learn: bool = True) -> speculator_pb2.ProposeRequest:
    return speculator_pb2.ProposeRequest(finished=speculator_pb2.RequestFinished(request_id=request_id, learn=learn))


def batch(
    *updates: speculator_pb2.ProposeRequest, finished: list[speculator_pb2.RequestFinished] = ()
) -> speculator_pb2.ProposeRequest:
    return speculator_pb2.ProposeRequest(
        batch=speculator_pb2.UpdateBatch(contexts=[u.context for u in updates], finished=list(finished))
    )


class ProposeStream:
    """One Propose stream, written and read by the test."""

    def __init__(self, stub: speculator_pb2_grpc.SpeculatorServiceStub) -> None:
        self._out: asyncio.Queue = asyncio.Queue()
        self.call = stub.Propose(self._requests())

    async def _requests(self) -> AsyncIterator[speculator_pb2.ProposeRequest]:
        while (msg := await self._out.get()) is not None:
            yield msg

    def send(self, *messages: speculator_pb2.ProposeRequest) -> None:
        for m in messages:
            self._out.put_nowait(m)

    async def recv(self) -> speculator_pb2.ProposeResponse:
        return await asyncio.wait_for(self.call.read(), HANG_GUARD_S)

    async def close(self) -> None:
        """Half-close and wait for the server to end the stream."""
        self._out.put_nowait(None)
        assert await asyncio.wait_for(self.call.read(), HANG_GUARD_S) is grpc.aio.EOF


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Wait until ``check()`` is true (for background work: learning, cleanup)."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not await check():
            await asyncio.sleep(0.01)


@asynccontextmanager
async def speculator_on(port: int) -> AsyncIterator[Runtime]:
    args = parse_flags("speculator", [*common_flags(port, 0), *main.FLAGS], ["--port", str(port)], environ={})
    async with serve("speculator", main.build, args, port=port, grace_seconds=1.0) as rt:
        yield rt


@asynccontextmanager
async def proposer_for(
    port: int, budget_ms: float = BUDGET_MS
) -> AsyncIterator[tuple[SpeculatorProposer, CollectorRegistry]]:
    registry = CollectorRegistry()
    proposer = SpeculatorProposer(f"127.0.0.1:{port}", budget_ms=budget_ms, registry=registry)
    await proposer.start()
    try:
        yield proposer, registry
    finally:
        await proposer.close()


async def connected(proposer: SpeculatorProposer) -> None:
    async def check() -> bool:
        return proposer.connected

    await eventually(check)


async def server_stats(port: int) -> speculator_pb2.StatsResponse:
    async with create_channel(f"127.0.0.1:{port}") as channel:
        return await speculator_pb2_grpc.SpeculatorServiceStub(channel).Stats(speculator_pb2.StatsRequest())


@pytest.fixture
async def speculator() -> AsyncIterator[Runtime]:
    async with serve_main("speculator", main, []) as rt:
        yield rt


@pytest.fixture
async def stub(speculator: Runtime) -> AsyncIterator[speculator_pb2_grpc.SpeculatorServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{speculator.port}") as channel:
        yield speculator_pb2_grpc.SpeculatorServiceStub(channel)
