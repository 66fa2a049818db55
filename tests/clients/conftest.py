"""One mesh, started as real processes, for the Go and TypeScript client suites.

The clients' own tests (``go test``, ``node --test``) find it through the
environment that ``client_env`` returns; without those variables they skip.
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.mesh_helpers import start_mesh, write_model

API_KEY = "test-key"


@pytest.fixture(scope="session")
def client_mesh(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("clients-model") / "llama")
    m = start_mesh(model, tmp_path_factory.mktemp("clients-mesh"), role_env={"gateway": {"KVMESH_API_KEYS": API_KEY}})
    yield m
    m.stop()


@pytest.fixture(scope="session")
def client_env(client_mesh) -> dict[str, str]:
    """The environment a client test suite runs with: where the gateway is, its key, its metrics, and
    the decode worker's pid. The cancellation tests stop that worker (SIGSTOP) so a request stays in
    flight until they cancel it: this tiny model answers 400 tokens faster than a loaded machine
    schedules the client's cancel."""
    metrics_port = client_mesh.topology.get("gateway").metrics_port
    return {
        **os.environ,
        "KVMESH_GATEWAY_ADDRESS": client_mesh.address("gateway"),
        "KVMESH_API_KEY": API_KEY,
        "KVMESH_METRICS_URL": f"http://127.0.0.1:{metrics_port}/metrics",
        "KVMESH_DECODE_PID": str(client_mesh.process("decode-0").pid),
    }
