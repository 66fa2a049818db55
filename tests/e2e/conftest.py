from __future__ import annotations

import grpc
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2_grpc
from tests.e2e.mesh_helpers import start_mesh, write_model


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("e2e-model") / "llama")


@pytest.fixture(scope="session")
def mesh(e2e_model, tmp_path_factory):
    """One shared mesh for the tests that do not kill any part of it."""
    m = start_mesh(
        e2e_model,
        tmp_path_factory.mktemp("mesh"),
        role_env={"decode": {"KVMESH_NUM_SPECULATIVE_TOKENS": "4"}},
    )
    yield m
    m.stop()


@pytest.fixture
async def gateway(mesh):
    async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)
