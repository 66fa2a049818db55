from __future__ import annotations

import grpc
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2_grpc
from kvmesh.runtime.otlp_receiver import OtlpReceiver
from tests.e2e.mesh_helpers import start_mesh, traced, write_model


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("e2e-model") / "llama")


@pytest.fixture(scope="session")
def otlp():
    """Where the meshes of the tests send their traces."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def mesh(e2e_model, tmp_path_factory, otlp):
    """One shared mesh for the tests that do not kill any part of it; it traces every request."""
    m = start_mesh(
        e2e_model,
        tmp_path_factory.mktemp("mesh"),
        role_env=traced(otlp, {"decode": {"KVMESH_NUM_SPECULATIVE_TOKENS": "4"}}),
    )
    yield m
    m.stop()


@pytest.fixture
async def gateway(mesh):
    async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)
