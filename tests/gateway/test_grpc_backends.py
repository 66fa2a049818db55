"""GrpcBackends: status codes become domain errors; a stream broken by its server is UNAVAILABLE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import FailedPrecondition, InvalidArgument, KvmeshError, ResourceExhausted, Unavailable
from kvmesh.runtime import Runtime
from kvmesh.runtime.client_errors import from_rpc_error
from kvmesh.runtime.ports import free_port
from services.gateway.backends import RouterUnreachable
from services.gateway.grpc_backends import GrpcBackends
from tests.gateway.grpc_fakes import Mesh, build_mesh


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "cls", "message"),
    [
        (grpc.StatusCode.UNAVAILABLE, Unavailable, "decode-0: Socket closed"),
        (grpc.StatusCode.CANCELLED, Unavailable, "decode-0: the call was cancelled on the server side: Socket closed"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, Unavailable, "decode-0: no answer within 2 s"),
        (grpc.StatusCode.UNKNOWN, Unavailable, "decode-0: Socket closed"),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument, "Socket closed"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted, "Socket closed"),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition, "Socket closed"),
        (grpc.StatusCode.PERMISSION_DENIED, KvmeshError, "decode-0: PERMISSION_DENIED: Socket closed"),
    ],
)
def test_status_codes_become_domain_errors(code, cls, message) -> None:
    error = from_rpc_error(_rpc_error(code, "Socket closed"), "decode-0", 2.0)

    assert type(error) is cls and error.message == message


async def test_a_router_that_cannot_be_asked_is_unreachable_but_its_own_unavailable_answer_is_not() -> None:
    mesh = Mesh()
    rt = Runtime("router", build_mesh(mesh), metrics_port=None)
    await rt.start()
    alive = GrpcBackends(f"127.0.0.1:{rt.port}", rpc_timeout_s=0.3)
    dead = GrpcBackends(f"127.0.0.1:{free_port()}", rpc_timeout_s=0.3)
    try:
        mesh.route_error = Unavailable("no live prefill or decode worker to route to")
        with pytest.raises(Unavailable) as answered:
            await alive.route(router_pb2.RouteRequest())
        assert type(answered.value) is Unavailable and "no live prefill" in answered.value.message

        mesh.route_error, mesh.route_delay_s = None, 5.0  # hung: no answer by the deadline
        with pytest.raises(RouterUnreachable, match="no answer within 0.3 s"):
            await alive.route(router_pb2.RouteRequest())
        with pytest.raises(RouterUnreachable, match="router"):
            await dead.route(router_pb2.RouteRequest())
    finally:
        await rt.stop(grace_seconds=0)
        await alive.close()
        await dead.close()


async def test_after_the_router_was_unreachable_route_calls_wait_less_until_it_answers_again() -> None:
    mesh = Mesh()
    rt = Runtime("router", build_mesh(mesh), metrics_port=None)
    await rt.start()
    backends = GrpcBackends(f"127.0.0.1:{rt.port}", rpc_timeout_s=1.0, suspect_route_timeout_s=0.2)
    try:
        mesh.route_delay_s = 5.0  # hung
        with pytest.raises(RouterUnreachable, match="no answer within 1 s"):
            await backends.route(router_pb2.RouteRequest())
        with pytest.raises(RouterUnreachable, match="no answer within 0.2 s"):  # the outage is known: fall back soon
            await backends.route(router_pb2.RouteRequest())
        mesh.route_delay_s = 0.0
        await backends.route(router_pb2.RouteRequest())  # it answers again: the full deadline is back
        mesh.route_delay_s = 5.0
        with pytest.raises(RouterUnreachable, match="no answer within 1 s"):
            await backends.route(router_pb2.RouteRequest())
    finally:
        await rt.stop(grace_seconds=0)
        await backends.close()


@asynccontextmanager
async def held_decode_stream() -> AsyncIterator[tuple[Mesh, Runtime, AsyncIterator]]:
    """A decode stream through the backends that got its first message; the server holds the rest."""
    mesh = Mesh()
    mesh.hold_decode_after = 1
    rt = Runtime("decode", build_mesh(mesh), metrics_port=None)
    await rt.start()
    backends = GrpcBackends(f"127.0.0.1:{rt.port}")
    try:
        stream = backends.decode(f"127.0.0.1:{rt.port}", decode_pb2.DecodeRequest())
        await anext(stream)
        await mesh.decode_held.wait()
        yield mesh, rt, stream
    finally:
        await rt.stop()
        await backends.close()


async def test_a_decode_stream_whose_server_stops_is_unavailable() -> None:
    async with held_decode_stream() as (_, rt, stream):
        stopping = asyncio.create_task(rt.stop(grace_seconds=0))
        with pytest.raises(Unavailable):
            await anext(stream)
        await stopping


async def test_closing_a_decode_stream_cancels_it_on_the_server() -> None:
    async with held_decode_stream() as (mesh, _, stream):
        await stream.aclose()
        await asyncio.wait_for(mesh.decode_cancelled.wait(), 10)
