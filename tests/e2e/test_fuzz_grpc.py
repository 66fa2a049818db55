"""Every internal gRPC method of a real mesh, fuzzed with a fixed seed and budget (bench/fuzz_grpc.py runs
longer): no INTERNAL, UNKNOWN or hang, no process down, nothing left held, and a normal request still
answered with the tokens it gets alone after each service's batch."""

from __future__ import annotations

import zlib

import grpc
import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.mesh_helpers import start_mesh
from tests.e2e.test_mesh import local_greedy
from tests.fuzz.harness import SERVICES, Fuzzer

pytestmark = pytest.mark.timeout(900)

EXAMPLES = 12  # a method: CI's budget (about 450 calls in all)
LEASE_TTL_MS = 1000  # and at most twice that: a fuzzed Prefill's lease is gone before the leak check
PROMPT = list(range(60, 90))


@pytest.fixture(scope="module")
def fuzz_mesh(e2e_model, tmp_path_factory):
    m = start_mesh(
        e2e_model,
        tmp_path_factory.mktemp("fuzz"),
        role_env={
            "prefill": {"KVMESH_LEASE_TTL_MS": str(LEASE_TTL_MS), "KVMESH_MAX_LEASE_TTL_MS": str(2 * LEASE_TTL_MS)},
            "decode": {"KVMESH_NUM_SPECULATIVE_TOKENS": "3"},
        },
    )
    yield m
    m.stop()


def normal_request(mesh, model) -> None:
    expected = local_greedy(model, [PROMPT], 8)[0]
    with grpc.insecure_channel(mesh.address("gateway")) as channel:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=PROMPT),
            sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        )
        got = [t for msg in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request) for t in msg.token_ids]
    assert got == expected


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_fuzzed_service_answers_every_call_and_keeps_serving(fuzz_mesh, e2e_model, service):
    fuzzer = Fuzzer(fuzz_mesh)
    process, _ = SERVICES[service]
    methods = [(svc, method) for proc, svc, method in fuzzer.methods() if proc == process]
    for svc, method in methods:
        fuzzer.fuzz(process, svc, method, EXAMPLES, at=zlib.crc32(f"{service}/{method.name}".encode()))
    assert fuzzer.tally.broken == [], "\n".join(fuzzer.tally.broken[:10])
    assert fuzzer.tally.calls == EXAMPLES * len(methods)
    fuzzer.check_mesh(lambda: normal_request(fuzz_mesh, e2e_model), settle_s=3 * LEASE_TTL_MS / 1000)
