"""One mesh of real processes for the OpenAI API tests, and a second, guarded gateway process on it."""

from __future__ import annotations

import dataclasses
import socket
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import openai
import pytest

from kvmesh.launcher.spec import Topology
from kvmesh.launcher.supervisor import Mesh
from kvmesh.runtime.ports import free_port
from tests.e2e.mesh_helpers import http_url, start_mesh, write_model

MODEL = "llama"  # the model folder's name, which the gateway serves it as
API_KEY = "sk-test-team-a"


def all_full_blocks(prompt_tokens: int, cached: int, block: int = 16) -> bool:
    """Every full block of the prompt came from cache, except that the last token is always computed
    (its logits give the first new token), so a prompt ending on a block boundary recomputes that block."""
    return cached % block == 0 and ((prompt_tokens - 1) // block) * block <= cached <= prompt_tokens


def post_raw(base_url: str, body: bytes, headers: bytes = b"") -> socket.socket:
    """A raw connection with a chat completion request sent on it, for tests that read, or hang up, by hand."""
    url = urllib.parse.urlsplit(base_url)
    conn = socket.create_connection((url.hostname, url.port), timeout=30)
    conn.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvmesh\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n%s" % (headers, len(body), body)
    )
    return conn


@pytest.fixture(scope="session")
def openai_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("openai-model") / MODEL)


@pytest.fixture(scope="session")
def mesh(openai_model, tmp_path_factory) -> Iterator[Mesh]:
    # Room for the load test's 64 concurrent sequences at once.
    blocks = {"KVMESH_NUM_BLOCKS": "512"}
    m = start_mesh(openai_model, tmp_path_factory.mktemp("openai-mesh"), role_env={"prefill": blocks, "decode": blocks})
    yield m
    m.stop()


@pytest.fixture(scope="session")
def base_url(mesh: Mesh) -> str:
    return http_url(mesh)


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
async def aclient(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    # Closed by the test's own event loop: left to the garbage collector, it would close on a dead one.
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@dataclass(frozen=True)
class Guarded:
    url: str
    process: Mesh

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def guarded(mesh: Mesh, tmp_path_factory) -> Iterator[Guarded]:
    """A second gateway process on the same mesh, with API keys on and one request in flight at most."""
    spec = mesh.topology.get("gateway")
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    env = {
        **spec.env,
        "KVMESH_PORT": str(port),
        "KVMESH_METRICS_PORT": str(metrics_port),
        "KVMESH_HTTP_PORT": str(http_port),
        "KVMESH_API_KEYS": f"{API_KEY} team-a",
        "KVMESH_MAX_INFLIGHT_REQUESTS": "1",
    }
    gateway = dataclasses.replace(spec, name="gateway-guarded", env=env, port=port, metrics_port=metrics_port)
    process = Mesh(Topology((gateway,)), tmp_path_factory.mktemp("guarded")).start()
    yield Guarded(f"http://{spec.host}:{http_port}", process)
    process.stop()
