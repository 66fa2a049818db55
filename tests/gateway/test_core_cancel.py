"""A client that goes away stops the work downstream and frees the request's KV lease; admission limits."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.errors import ResourceExhausted
from services.gateway.core import Gateway
from tests.gateway.fakes import FakeMesh
from tests.gateway.helpers import collect, make_gateway, request, sample


async def _read_until_held(gateway: Gateway, mesh: FakeMesh) -> asyncio.Task:
    """A client reading a request's stream, once the mesh reached its hold point."""
    task = asyncio.create_task(collect(gateway, request()))
    await asyncio.wait_for(mesh.held.wait(), 10)
    return task


async def test_cancel_mid_decode_cancels_the_decode_stream(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 2
    gateway = make_gateway(model, mesh)
    task = await _read_until_held(gateway, mesh)
    assert gateway.inflight == 1

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert mesh.cancelled == [("decode", "d0")] and mesh.open_streams == 0
    assert gateway.inflight == 0
    assert sample(gateway, "kvmesh_gateway_inflight_requests") == 0
    assert sample(gateway, "kvmesh_gateway_requests_total", method="generate", outcome="cancelled") == 1


async def test_closing_the_stream_between_chunks_cancels_decode(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    stream = gateway.generate(request(), "rid")

    await anext(stream)
    await stream.aclose()  # what the servicer does when the client is gone

    assert mesh.cancelled == [("decode", "d0")]
    assert gateway.inflight == 0


async def test_cancel_before_decode_has_the_kv_aborts_the_lease(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 0  # decode holds before pulling/ACKing the lease
    gateway = make_gateway(model, mesh)
    task = await _read_until_held(gateway, mesh)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gateway.wait_idle()

    assert mesh.released == [("p0:1", "lease-1", prefill_pb2.LEASE_OUTCOME_ABORT)]
    assert mesh.leases == set()


async def test_cancel_mid_prefill_cancels_the_prefill_call(model) -> None:
    mesh = FakeMesh()
    mesh.hold_prefill = True
    gateway = make_gateway(model, mesh)
    task = await _read_until_held(gateway, mesh)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gateway.wait_idle()

    assert mesh.cancelled == [("prefill", "p0")]
    assert mesh.decodes == [] and mesh.leases == set()
    assert gateway.inflight == 0


async def test_a_prefill_answer_racing_the_cancel_has_its_lease_aborted(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    answered = asyncio.Event()
    real_prefill = mesh.prefill

    async def prefill_then_client_leaves(address: str, req: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        response = await real_prefill(address, req)
        answered.set()
        return response

    mesh.prefill = prefill_then_client_leaves
    task = asyncio.create_task(collect(gateway, request()))
    await answered.wait()
    task.cancel()  # the answer is in, the gateway has not resumed yet
    with pytest.raises(asyncio.CancelledError):
        await task
    await gateway.wait_idle()

    assert mesh.decodes == []
    assert mesh.released == [("p0:1", "lease-1", prefill_pb2.LEASE_OUTCOME_ABORT)]
    assert mesh.leases == set()


async def test_requests_beyond_the_limit_are_refused_until_one_finishes(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 1
    gateway = make_gateway(model, mesh, max_inflight=1)
    task = await _read_until_held(gateway, mesh)

    with pytest.raises(ResourceExhausted, match="limit of 1 requests in flight"):
        await collect(gateway, request())
    assert sample(gateway, "kvmesh_gateway_requests_total", method="generate", outcome="resource_exhausted") == 1

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    mesh.hold_decode_at.clear()
    assert len(await collect(gateway, request())) == 4
    assert gateway.inflight == 0
