"""The gateway process serves both APIs on one core: shared metrics, and a shutdown that drains HTTP too."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import grpc
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.runtime import common_flags, parse_flags, serve
from services.gateway.main import FLAGS, build
from tests.gateway.grpc_fakes import Mesh, build_mesh
from tests.gateway.helpers import PROMPT, gateway_argv
from tests.service_helpers import free_port


@pytest.fixture
async def mesh():
    m = Mesh()
    async with serve("mesh", build_mesh(m), metrics_port=None) as rt:
        m.address = f"127.0.0.1:{rt.port}"
        yield m


def _args(mesh: Mesh, model_dir, http_port: int):
    argv = gateway_argv(mesh.address, model_dir, http_port, "--grace-seconds", "0.5")
    return parse_flags("kvmesh-gateway", [*common_flags(0, 0), *FLAGS], argv, environ={})


def _scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


async def test_both_apis_share_the_core_and_its_metrics(mesh, model_dir) -> None:
    http_port = free_port()
    async with serve("gateway", build, _args(mesh, model_dir, http_port), grace_seconds=0.5) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            [c async for c in stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT)))]
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
            async with http.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body) as r:
                assert r.status == 200
        over_http = await asyncio.to_thread(_scrape, http_port)
        on_metrics_port = await asyncio.to_thread(_scrape, rt.metrics_port)

    for text in (over_http, on_metrics_port):
        assert 'kvmesh_gateway_requests_total{method="generate",outcome="ok"} 2.0' in text
        assert (
            'kvmesh_rpc_requests_total{code="OK",method="Generate",service="kvmesh.api.gateway.v1.GatewayService"}'
            in text
        )
        assert 'kvmesh_http_requests_total{route="/v1/completions",status="200"} 1.0' in text


async def test_shutdown_ends_http_streams_after_the_grace_period_and_cancels_them_downstream(mesh, model_dir) -> None:
    mesh.hold_decode_after = 2
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    async with serve("gateway", build, _args(mesh, model_dir, http_port), grace_seconds=0.5) as rt:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": PROMPT, "stream": True}
            response = await http.post(url + "/v1/completions", json=body)
            await response.content.readline()
            await asyncio.wait_for(mesh.decode_held.wait(), 10)

            await rt.stop()

            await asyncio.wait_for(mesh.decode_cancelled.wait(), 10)
            with pytest.raises(aiohttp.ClientPayloadError):  # cut off: no [DONE]
                await response.content.read()
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(url + "/health")
