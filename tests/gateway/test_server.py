"""The gateway service in-process over real gRPC, against fake router/prefill/decode servicers."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.runtime import Runtime, parse_flags, serve
from services.gateway.main import FLAGS, build
from tests.gateway.conftest import LABEL
from tests.gateway.grpc_fakes import TOKENS, Mesh, build_mesh
from tests.gateway.helpers import gateway_argv

PROMPT = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=list(range(40, 60))))


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    m = Mesh()
    async with serve("mesh", build_mesh(m), metrics_port=None) as rt:
        m.address = f"127.0.0.1:{rt.port}"
        yield m


@asynccontextmanager
async def running_gateway(
    model_dir: Path, mesh: Mesh, *flags: str
) -> AsyncIterator[tuple[gateway_pb2_grpc.GatewayServiceStub, Runtime]]:
    argv = gateway_argv(mesh.address, model_dir, 0, *flags)
    async with serve("gateway", build, parse_flags("kvmesh-gateway", FLAGS, argv, environ={})) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            yield gateway_pb2_grpc.GatewayServiceStub(channel), rt


async def _metric(rt: Runtime, name: str) -> float:
    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{rt.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    for line in (await asyncio.to_thread(scrape)).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def _until(predicate, what: str) -> None:
    try:
        async with asyncio.timeout(10):
            while not await predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"gave up waiting for {what}") from None


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_tokenize_and_list_models(model_dir, mesh) -> None:
    async with running_gateway(model_dir, mesh) as (stub, _):
        tokens = await stub.Tokenize(gateway_pb2.TokenizeRequest(text="x = 1"))
        models = await stub.ListModels(gateway_pb2.ListModelsRequest())

    assert list(tokens.token_ids) and models.models[0].id == "tiny" and models.models[0].owned_by == LABEL


async def test_generate_streams_and_carries_the_request_id_to_every_hop(model_dir, mesh) -> None:
    async with running_gateway(model_dir, mesh) as (stub, _):
        chunks = [c async for c in stub.Generate(PROMPT, metadata=(("x-request-id", "req-42"),))]

    assert [t for c in chunks for t in c.token_ids] == TOKENS
    assert {c.request_id for c in chunks} == {"req-42"}
    assert mesh.request_ids == ["req-42"] * 3  # Route, Prefill, Decode


async def test_chat_streams_chat_responses(model_dir, mesh) -> None:
    request = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    async with running_gateway(model_dir, mesh) as (stub, _):
        chunks = [c async for c in stub.Chat(request)]

    assert isinstance(chunks[0], gateway_pb2.ChatResponse)
    assert [t for c in chunks for t in c.token_ids] == TOKENS
    assert chunks[-1].final.usage.completion_tokens == len(TOKENS)


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (
            gateway_pb2.GenerateRequest(text=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt is empty: set text or token_ids",
        ),
        (
            gateway_pb2.GenerateRequest(model="other", text="x"),
            grpc.StatusCode.NOT_FOUND,
            "model 'other' is not served here",
        ),
    ],
)
async def test_bad_input_maps_to_its_status(model_dir, mesh, request_, code, message) -> None:
    async with running_gateway(model_dir, mesh) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.Generate(request_)]

    assert info.value.code() == code and message in info.value.details()


async def test_a_router_that_does_not_answer_gives_unavailable_at_the_deadline(model_dir, mesh) -> None:
    mesh.route_delay_s = 30
    async with running_gateway(model_dir, mesh, "--rpc-timeout-seconds", "0.2") as (stub, rt):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.Generate(PROMPT)]
        assert await _metric(rt, "kvmesh_gateway_inflight_requests") == 0

    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (
        info.value.details() == f"router ({mesh.address}): no answer within 0.2 s; "
        "no known workers to route on without it (no answer since this gateway started)"
    )


async def test_a_dead_decode_worker_is_retried_and_its_lease_aborted(model_dir, mesh) -> None:
    mesh.dead_decode_address = _dead_address()
    async with running_gateway(model_dir, mesh) as (stub, _):
        chunks = [c async for c in stub.Generate(PROMPT)]

    assert [t for c in chunks for t in c.token_ids] == TOKENS
    assert mesh.released == ["lease-1"]  # the first attempt's hand-off, aborted


async def test_a_decode_failure_after_tokens_without_migrations_gives_unavailable(model_dir, mesh) -> None:
    mesh.fail_decode_after = 2
    async with running_gateway(model_dir, mesh, "--max-migrations", "0") as (stub, rt):
        call = stub.Generate(PROMPT)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                received.append(chunk)
        assert await _metric(rt, "kvmesh_gateway_inflight_requests") == 0

    assert len(received) == 2
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == (
        f"decode worker decode-0 ({mesh.address}) failed: the worker is going away "
        "after 2 tokens were streamed, and this request already moved 0 times (the limit)"
    )


async def test_client_cancel_cancels_decode_and_the_inflight_gauge_returns_to_zero(model_dir, mesh) -> None:
    mesh.hold_decode_after = 2
    async with running_gateway(model_dir, mesh) as (stub, rt):
        call = stub.Generate(PROMPT)
        await call.read()
        await asyncio.wait_for(mesh.decode_held.wait(), 10)
        assert await _metric(rt, "kvmesh_gateway_inflight_requests") == 1

        call.cancel()

        await asyncio.wait_for(mesh.decode_cancelled.wait(), 10)
        await _until(lambda: _zero_inflight(rt), "the in-flight gauge back at 0")
        assert await _metric(rt, 'kvmesh_gateway_requests_total{method="generate",outcome="cancelled"}') == 1


async def _zero_inflight(rt: Runtime) -> bool:
    return await _metric(rt, "kvmesh_gateway_inflight_requests") == 0


async def test_requests_beyond_the_limit_get_resource_exhausted(model_dir, mesh) -> None:
    mesh.hold_decode_after = 1
    async with running_gateway(model_dir, mesh, "--max-inflight-requests", "1") as (stub, _):
        first = stub.Generate(PROMPT)
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.Generate(PROMPT)]
        first.cancel()

    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
