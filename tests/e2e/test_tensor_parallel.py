"""Tensor-parallel workers in a mesh of real processes: a prefill worker over 2 ranks handing KV to a
decode worker on 1, and the reverse. Blocks travel whole (every KV head: the one wire layout), so the
two degrees meet without a special case, and the greedy tokens are what one engine here gives alone.
Every prompt goes through the prefill worker (the e2e meshes never prefill on decode)."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from tests.e2e.mesh_helpers import metrics, start_mesh
from tests.e2e.stream_breaker import read_into

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = [[(13 * i + k) % 500 + 1 for i in range(20 + 23 * k)] for k in range(3)]  # 1 to 5 blocks
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def colocated(e2e_model) -> list[list[int]]:
    done = LLMEngine(e2e_model, EngineConfig(num_blocks=64)).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    return [c.token_ids for c in done]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
async def test_kv_moves_between_tensor_parallel_degrees(e2e_model, tmp_path, colocated, prefill_tp, decode_tp):
    tp = {"prefill": {"KVMESH_TENSOR_PARALLEL_SIZE": str(prefill_tp)}}
    tp["decode"] = {"KVMESH_TENSOR_PARALLEL_SIZE": str(decode_tp)}
    mesh = start_mesh(e2e_model, tmp_path, role_env=tp)
    try:
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            got = []
            for prompt in PROMPTS:
                request = gateway_pb2.GenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=prompt),
                    sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                )
                got.append([t for m in await read_into(gateway.Generate(request), []) for t in m.token_ids])
        assert got == colocated
        decode = metrics(mesh, "decode-0")
        # The prompts' KV crossed, over gRPC (a tensor-parallel side keeps NIXL off), and none of it failed.
        assert decode["kvmesh_decode_bytes_pulled_total"] > 0
        assert decode["kvmesh_decode_transfer_failures_total"] == 0
        split = "prefill-0" if prefill_tp > 1 else "decode-0"
        assert "split over tensor-parallel ranks" in (tmp_path / "logs" / f"{split}.log").read_text()
    finally:
        mesh.stop()
