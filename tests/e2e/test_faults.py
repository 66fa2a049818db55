"""A decode worker killed mid-stream: a clear error, no routing to the dead, nothing leaked."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from kvmesh.common.v1 import sampling_pb2, worker_pb2
from kvmesh.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.e2e.mesh_helpers import metrics, start_mesh

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def two_decode_mesh(e2e_model, tmp_path):
    m = start_mesh(
        e2e_model,
        tmp_path,
        decode_workers=2,
        role_env={"router": {"KVMESH_LEASE_TTL_MS": "1500"}, "prefill": {"KVMESH_LEASE_TTL_MS": "3000"}},
    )
    yield m
    m.stop()


def _request(n: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=list(range(50, 90))),
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    )


async def _live_decode_workers(router) -> set[str]:
    resp = await router.ListWorkers(router_pb2.ListWorkersRequest(role=worker_pb2.WORKER_ROLE_DECODE))
    return {w.endpoint.worker_id for w in resp.workers}


async def test_killed_decode_worker(two_decode_mesh):
    mesh = two_decode_mesh
    async with grpc.aio.insecure_channel(mesh.address("gateway")) as gch, \
            grpc.aio.insecure_channel(mesh.address("router")) as rch:
        gateway = gateway_pb2_grpc.GatewayServiceStub(gch)
        router = router_pb2_grpc.RouterServiceStub(rch)
        assert await _live_decode_workers(router) == {"decode-0", "decode-1"}

        call = gateway.Generate(_request(450))
        await call.read()
        victim = next(
            w for w in ("decode-0", "decode-1") if metrics(mesh, w)["kvmesh_decode_active_requests"] == 1
        )
        survivor = ({"decode-0", "decode-1"} - {victim}).pop()
        mesh.kill(victim, signal.SIGKILL)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            async def drain():
                while await call.read() != grpc.aio.EOF:
                    pass

            await asyncio.wait_for(drain(), timeout=20)  # a bound against hanging, not a speed test
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert victim in err.value.details()

        # The router forgets the dead worker once its lease lapses; new requests still work.
        for _ in range(100):
            if await _live_decode_workers(router) == {survivor}:
                break
            await asyncio.sleep(0.1)
        assert await _live_decode_workers(router) == {survivor}
        for _ in range(3):
            tokens = []
            async for msg in gateway.Generate(_request(4)):
                tokens += msg.token_ids
            assert len(tokens) == 4

        # Nothing stranded: the prefill worker holds no leases or blocks, the gateway no requests.
        for _ in range(100):
            p = metrics(mesh, "prefill-0")
            if p["kvmesh_prefill_active_leases"] == 0 and p["kvmesh_engine_kv_blocks_in_use"] == 0:
                break
            await asyncio.sleep(0.1)
        assert p["kvmesh_prefill_active_leases"] == 0
        assert p["kvmesh_engine_kv_blocks_in_use"] == 0
        assert metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"] == 0
        assert metrics(mesh, survivor)["kvmesh_engine_kv_blocks_in_use"] == 0
