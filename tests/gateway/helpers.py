from __future__ import annotations

from pathlib import Path

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.core import Gateway
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import ServedModel
from tests.gateway.fakes import FakeMesh

PROMPT = list(range(40, 80))  # 40 tokens: two full blocks and a partial one


def make_gateway(model: ServedModel, mesh: FakeMesh, **kwargs) -> Gateway:
    return Gateway(model, mesh, **{"metrics": GatewayMetrics(), **kwargs})


def request(prompt: list[int] | str = PROMPT, **sampling) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(sampling=sampling_pb2.SamplingParams(**sampling), cache_salt="tenant-a")
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


async def collect(gateway: Gateway, req: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateResponse]:
    return [chunk async for chunk in gateway.generate(req, "rid-1")]


def sample(gateway: Gateway, name: str, **labels: str) -> float:
    value = gateway._metrics.registry.get_sample_value(name, labels)  # noqa: SLF001 - tests read the metrics
    return 0.0 if value is None else value


def gateway_argv(router_address: str, model_dir: Path, http_port: int | str, *flags: str) -> list[str]:
    """The gateway's flags for a test: the fake mesh's router, the test model served as "tiny"."""
    return [
        *("--router-address", router_address, "--model", str(model_dir), "--model-name", "tiny"),
        *("--http-port", str(http_port), *flags),
    ]
