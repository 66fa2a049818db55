"""Fuzzing a running mesh's internal gRPC APIs, and checking after each batch that nothing broke.

``Fuzzer`` calls every method of every service the way any pod in the cluster can: messages drawn from the
method's request descriptor (``messages``), and bytes that are no message at all. Each call has a deadline;
its status is counted per (service, method). What must never be seen: INTERNAL or UNKNOWN (a failure the
service did not own), a deadline passed (a hang), a process gone. ``check_mesh`` then asserts the mesh is as
it was: every process alive and SERVING, nothing left in flight, no block or lease held, and a normal
request through the gateway answered with the tokens it gets alone.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.api.speculator.v1 import speculator_pb2
from kvmesh.launcher.supervisor import Mesh
from kvmesh.runtime.authz import PUBLIC, allowed
from kvmesh.runtime.channel import create_blocking_channel
from kvmesh.runtime.tls import TlsFiles
from tests.e2e.mesh_helpers import metrics
from tests.fuzz.messages import messages, mutations, raw_bytes

CALL_DEADLINE_S = 30.0  # past it a call counts as a hang (a valid request's longest answer is seconds)
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
# The process each service's API is served by in a one-worker mesh, and its generated module.
SERVICES: dict[str, tuple[str, ModuleType]] = {
    "gateway": ("gateway", gateway_pb2),
    "router": ("router", router_pb2),
    "prefill": ("prefill-0", prefill_pb2),
    "decode": ("decode-0", decode_pb2),
    "kvstore": ("kvstore", kvstore_pb2),
    "speculator": ("speculator", speculator_pb2),
}
# A valid request of the methods that run the engine: the fuzzer also sends it with one field changed.
_PROMPT = list(range(60, 80))
_GREEDY = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=6)
TEMPLATES = {
    "DecodeService/Decode": decode_pb2.DecodeRequest(
        request_id="fuzz", prompt_token_ids=_PROMPT, sampling=_GREEDY, local=decode_pb2.LocalPrefill()
    ),
    "PrefillService/Prefill": prefill_pb2.PrefillRequest(request_id="fuzz", token_ids=_PROMPT, sampling=_GREEDY),
    "GatewayService/Generate": gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=_PROMPT), sampling=_GREEDY
    ),
    "RouterService/Route": router_pb2.RouteRequest(
        request_id="fuzz", tokens=router_pb2.TokenPrompt(token_ids=_PROMPT), max_new_tokens=6
    ),
}
# Gauges that read 0 on an idle mesh: anything else is a request, block or lease left behind.
IDLE_GAUGES = {
    "gateway": ["kvmesh_gateway_inflight_requests"],
    "prefill-0": ["kvmesh_prefill_active_leases", "kvmesh_engine_kv_blocks_in_use", "kvmesh_engine_running_sequences"],
    "decode-0": ["kvmesh_decode_active_requests", "kvmesh_engine_kv_blocks_in_use", "kvmesh_engine_running_sequences"],
}


@dataclass
class Tally:
    """Statuses seen, per "service/method", and the calls that broke a rule."""

    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)

    def add(self, where: str, code: grpc.StatusCode, details: str, request: object) -> None:
        self.statuses[(where, code.name)] += 1
        if code in FORBIDDEN:
            self.broken.append(f"{where}: {code.name} {details[:200]!r} for {str(request)[:300]!r}")

    @property
    def calls(self) -> int:
        return sum(self.statuses.values())


class Fuzzer:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.tally = Tally()

    def methods(self) -> Iterator[tuple[str, ServiceDescriptor, MethodDescriptor]]:
        for process, module in SERVICES.values():
            for service in module.DESCRIPTOR.services_by_name.values():
                for method in service.methods:
                    yield process, service, method

    def fuzz(self, process: str, service: ServiceDescriptor, method: MethodDescriptor, examples: int, at: int) -> None:
        """``examples`` calls of ``method``: messages of its request type, and raw bytes (seeded by ``at``)."""
        where = f"{service.name}/{method.name}"
        with create_blocking_channel(self.mesh.address(process), self._caller_identity(service, method)) as channel:
            call = _caller(channel, service, method)
            drawn = messages(method.input_type)
            if where in TEMPLATES:
                drawn = st.one_of(drawn, mutations(TEMPLATES[where]))
            requests = st.one_of(drawn.map(lambda m: m.SerializeToString()), raw_bytes())

            @settings(
                max_examples=examples,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @seed(at)
            @given(requests)
            def one(body: bytes) -> None:
                code, details = call(body)
                self.tally.add(where, code, details, body)

            one()

    def _caller_identity(self, service: ServiceDescriptor, method: MethodDescriptor) -> TlsFiles | None:
        """A role the mesh lets call ``method`` (so the fuzz reaches its validation, not the authorization)."""
        roles = allowed(service.full_name, method.name)
        return None if roles == PUBLIC else self.mesh.identity(sorted(roles)[0])

    def check_mesh(self, normal_request: Callable[[], None], settle_s: float) -> None:
        """Everything alive and SERVING, nothing left held once ``settle_s`` (a lease's TTL) passed, and
        ``normal_request`` (which asserts its own answer) served."""
        assert self.mesh.crashed() == [], self.mesh.crashed()
        for spec in self.mesh.topology.processes:
            assert self.mesh.process(spec.name).popen.poll() is None, f"{spec.name} exited"
            if spec.health != "redis":
                assert _serving(spec.address, spec.health_identity), f"{spec.name} is not SERVING"
        deadline = time.monotonic() + settle_s
        while True:
            held = {
                f"{p}:{g}": v
                for p, gauges in IDLE_GAUGES.items()
                for g, v in metrics(self.mesh, p).items()
                if g in gauges and v
            }
            if not held or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert held == {}, f"left behind after the batch: {held}"
        normal_request()


def _caller(
    channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor
) -> Callable[[bytes], tuple[grpc.StatusCode, str]]:
    """Calls ``method`` with a serialized request (a stream of it sent twice for client-streaming methods),
    reading any response stream to its end; returns the status."""
    path = f"/{service.full_name}/{method.name}"
    kind = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary"}
    make = getattr(channel, kind.get((method.client_streaming, method.server_streaming), "stream_stream"))
    stub = make(path, request_serializer=None, response_deserializer=None)

    def call(body: bytes) -> tuple[grpc.StatusCode, str]:
        request = iter([body, body]) if method.client_streaming else body
        try:
            answer = stub(request, timeout=CALL_DEADLINE_S)
            if method.server_streaming:
                for _ in answer:
                    pass
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    return call


def _serving(address: str, identity: TlsFiles | None) -> bool:
    with create_blocking_channel(address, identity) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
