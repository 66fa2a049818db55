"""Peers killed or hung mid-request, with real processes: streams migrate, deadlines fire, the mesh heals itself.

One supervised mesh (two decode workers, one prefill worker) serves every test
here. A decode worker killed or hung mid-stream: the gateway moves the stream
to the other one and the client sees the same tokens; the supervisor restarts
the victim, which registers with the router again before the next test. A hung
prefill worker, kvstore or router costs a deadline, not the request (the
router: for a bounded time).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.common.v1 import sampling_pb2, worker_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.launcher import RestartPolicy
from kvmesh.runtime import create_channel
from kvmesh.structured.spec import GrammarSpec
from tests.e2e.mesh_helpers import held, metrics, poll, start_mesh, traced
from tests.e2e.stream_breaker import break_mid_stream, read_into

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

DECODE = ("decode-0", "decode-1")
PROMPT = list(range(50, 90))
MAX_TOKENS = 460  # all the tiny model's context allows: a stream long enough to break in the middle
STALL_TIMEOUT_S = 4  # the gateway's bound on a decode stream's silence once tokens flow (a hung worker)
PREFILL_TIMEOUT_S = 3  # the gateway's deadline on a Prefill call (a hung prefill worker)
ROUTER_FALLBACK_S = 5  # how long the gateway routes on its last known workers while the router is out
SCHEMA = {"type": "array", "items": {"type": "boolean"}, "minItems": 80, "maxItems": 100}


@pytest.fixture(scope="module")
def faults_mesh(e2e_model, tmp_path_factory, otlp):
    m = start_mesh(
        e2e_model,
        tmp_path_factory.mktemp("faults"),
        decode_workers=2,
        role_env=traced(
            otlp,
            {
                "router": {"KVMESH_LEASE_TTL_MS": "1500"},
                "prefill": {"KVMESH_LEASE_TTL_MS": "3000"},
                "gateway": {
                    "KVMESH_TOKEN_STALL_TIMEOUT_SECONDS": str(STALL_TIMEOUT_S),
                    "KVMESH_RPC_TIMEOUT_SECONDS": "1",
                    "KVMESH_PREFILL_TIMEOUT_SECONDS": str(PREFILL_TIMEOUT_S),
                    "KVMESH_ROUTER_FALLBACK_SECONDS": str(ROUTER_FALLBACK_S),
                },
            },
        ),
        restart=RestartPolicy(initial_backoff_s=0.2),
    )
    yield m
    m.stop()


@pytest.fixture
async def stubs(faults_mesh):
    async with (
        grpc.aio.insecure_channel(faults_mesh.address("gateway")) as gch,
        create_channel(faults_mesh.address("router"), faults_mesh.identity("operator")) as rch,
    ):
        yield gateway_pb2_grpc.GatewayServiceStub(gch), router_pb2_grpc.RouterServiceStub(rch)


def _request(max_tokens: int, prompt: list[int] = PROMPT, **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=sampling_pb2.SamplingParams(**({"temperature": 0.0, "max_tokens": max_tokens} | sampling)),
    )


async def _complete(gateway, request) -> list[gateway_pb2.GenerateResponse]:
    return await read_into(gateway.Generate(request), [])


async def _tokens(gateway, n: int, prompt: list[int] = PROMPT) -> list[int]:
    return [t for m in await _complete(gateway, _request(n, prompt, ignore_eos=True)) for t in m.token_ids]


async def _live_workers(router) -> set[str]:
    resp = await router.ListWorkers(router_pb2.ListWorkersRequest())
    return {w.endpoint.worker_id for w in resp.workers}


async def _live_decode_workers(router) -> set[str]:
    resp = await router.ListWorkers(router_pb2.ListWorkersRequest(role=worker_pb2.WORKER_ROLE_DECODE))
    return {w.endpoint.worker_id for w in resp.workers}


async def _healed(mesh, router, victim: str, restarts: int) -> None:
    """The supervisor restarted the victim (its ``restarts``-th time), it serves, and the router routes to it."""
    spec = mesh.topology.get(victim)
    for _ in range(600):
        if mesh.restarts(victim) == restarts and await _live_decode_workers(router) == set(DECODE):
            try:
                async with create_channel(spec.address, spec.health_identity) as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass  # still loading
        await asyncio.sleep(0.1)
    raise AssertionError(f"{victim} did not come back: restarts {mesh.restarts(victim)}")


async def _no_leaks(mesh) -> None:
    """Each process lets go a moment after the client has its last token: poll until all have, then assert."""
    left = await asyncio.to_thread(poll, lambda: held(mesh, ["prefill-0"], DECODE), lambda h: not any(h.values()))
    assert not any(left.values()), left


async def _break_mid_stream(mesh, gateway, request, how: str) -> tuple[list[gateway_pb2.GenerateResponse], str, str]:
    """Start ``request``, then kill (SIGKILL) or hang (SIGSTOP) the decode worker streaming it.
    Returns what the client got, the victim, and the trace id the broken request ran in."""

    def freeze(worker: str) -> None:
        os.killpg(mesh.process(worker).pid, signal.SIGSTOP)

    def thaw(worker: str) -> None:
        os.killpg(mesh.process(worker).pid, signal.SIGCONT)

    reader, victim, trace_id = await break_mid_stream(mesh, gateway, request, DECODE, freeze, thaw)
    try:
        if how == "kill":
            mesh.crash(victim)
        return await asyncio.wait_for(reader, timeout=60), victim, trace_id  # a bound against hanging, not speed
    finally:
        if how == "hang":
            mesh.crash(victim)  # what an operator does with a hung worker; the supervisor brings it back


def _migration_is_traced(otlp, trace_id: str, victim: str) -> None:
    """The trace shows both decode workers: the gateway's call to each, the migration between, and the survivor
    resuming after the tokens already streamed (the victim's own spans died with it)."""
    (survivor,) = set(DECODE) - {victim}

    def calls(spans):
        return [s for s in spans if s.service == "kvmesh-gateway" and s.name == "decode"]

    def resumed(spans):
        return [s for s in spans if s.instance == survivor and s.name.endswith("DecodeService/Decode")]

    spans = otlp.wait_for(lambda s: len(calls(s)) == 2 and resumed(s), trace_id)
    assert [c.attributes["kvmesh.worker_id"] for c in sorted(calls(spans), key=lambda c: c.start_ns)] == [
        victim,
        survivor,
    ]
    (request,) = [s for s in spans if s.name == "gateway.generate"]
    assert "migration" in request.events
    assert resumed(spans)[0].attributes["kvmesh.resumed_tokens"] > 0


@pytest.mark.parametrize(
    ("how", "sampling"),
    [("kill", {}), ("hang", {}), ("kill", {"temperature": 1.0, "seed": 5})],
    ids=["kill", "hang", "kill-seeded-sampling"],
)
async def test_a_decode_worker_dying_or_hanging_mid_stream_is_invisible_to_the_client(
    faults_mesh, stubs, otlp, how, sampling
) -> None:
    mesh, (gateway, router) = faults_mesh, stubs
    request = _request(MAX_TOKENS, ignore_eos=True, **sampling)
    # Greedy, or sampled with a seed (output position i draws from (seed, i) alone): the text any healthy worker
    # gives, and the one the stream must carry on with after it moved.
    expected = await _complete(gateway, request)
    migrated_before = metrics(mesh, "gateway").get("kvmesh_gateway_migrations_total{outcome=resumed}", 0)

    restarts = {w: mesh.restarts(w) for w in DECODE}
    got, victim, trace_id = await _break_mid_stream(mesh, gateway, request, how)

    assert [t for m in got for t in m.token_ids] == [t for m in expected for t in m.token_ids]
    assert "".join(m.text for m in got) == "".join(m.text for m in expected)
    assert [m.offset for m in got] == [sum(len(m.token_ids) for m in got[:i]) for i in range(len(got))]
    final = got[-1].final
    assert final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(PROMPT), MAX_TOKENS)
    assert metrics(mesh, "gateway")["kvmesh_gateway_migrations_total{outcome=resumed}"] == migrated_before + 1
    await asyncio.to_thread(_migration_is_traced, otlp, trace_id, victim)

    await _healed(mesh, router, victim, restarts[victim] + 1)
    for _ in range(2):  # both workers serve again
        assert len([t for m in await _complete(gateway, _request(4, ignore_eos=True)) for t in m.token_ids]) == 4
    await _no_leaks(mesh)


async def test_a_structured_output_resumes_with_its_grammar_and_stays_valid(faults_mesh, stubs) -> None:
    mesh, (gateway, router) = faults_mesh, stubs
    spec = GrammarSpec.json_schema(SCHEMA)
    request = _request(MAX_TOKENS, structured_output=spec.to_pb())
    expected = await _complete(gateway, request)
    assert expected[-1].final.finish_reason == sampling_pb2.FINISH_REASON_STOP
    migrated_before = metrics(mesh, "gateway").get("kvmesh_gateway_migrations_total{outcome=resumed}", 0)

    restarts = {w: mesh.restarts(w) for w in DECODE}
    got, victim, _ = await _break_mid_stream(mesh, gateway, request, "kill")

    text = "".join(m.text for m in got)
    assert text == "".join(m.text for m in expected)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert got[-1].final.usage.completion_tokens == sum(len(m.token_ids) for m in got)
    assert metrics(mesh, "gateway")["kvmesh_gateway_migrations_total{outcome=resumed}"] == migrated_before + 1
    await _healed(mesh, router, victim, restarts[victim] + 1)
    await _no_leaks(mesh)


@pytest.mark.parametrize("peer", ["prefill-0", "kvstore"])
async def test_a_hung_prefill_worker_or_kvstore_costs_a_deadline_not_the_request(faults_mesh, stubs, peer) -> None:
    """Prefill hung before its hand-off: the call's deadline, then the retry (the router has no other prefill
    worker, so decode prefills). The kvstore hung: lookups time out and the workers compute instead."""
    mesh, (gateway, router) = faults_mesh, stubs
    # A prompt no worker holds yet, so its blocks are looked up in the kvstore.
    prompt = list(range(100, 140)) if peer == "kvstore" else PROMPT
    pid = mesh.process(peer).pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        during = await asyncio.wait_for(_tokens(gateway, 64, prompt), timeout=60)
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert during == await _tokens(gateway, 64, prompt)
    if peer == "prefill-0":
        assert metrics(mesh, "gateway")["kvmesh_gateway_retries_total{stage=prefill}"] >= 1
    for _ in range(300):  # a stopped worker's lease lapsed: it registers again
        if await _live_workers(router) == {"prefill-0", *DECODE, "kvstore"}:
            break
        await asyncio.sleep(0.1)
    assert await _tokens(gateway, 64, prompt) == during
    await _no_leaks(mesh)


async def test_a_hung_router_is_routed_around_for_a_bounded_time_then_unavailable(faults_mesh, stubs) -> None:
    mesh, (gateway, router) = faults_mesh, stubs
    for _ in range(4):  # the gateway learns both decode workers from the router's plans
        await _tokens(gateway, 4)
    expected = await _tokens(gateway, 64)
    fallbacks = metrics(mesh, "gateway").get("kvmesh_gateway_router_fallbacks_total", 0)
    router_pid = mesh.process("router").pid
    os.killpg(router_pid, signal.SIGSTOP)  # hung, not dead: Route gets no answer, only its deadline
    stopped_at = time.monotonic()
    try:
        assert await _tokens(gateway, 64) == expected  # routed on the last known workers, prefilled locally
        assert metrics(mesh, "gateway")["kvmesh_gateway_router_fallbacks_total"] == fallbacks + 1

        await asyncio.sleep(max(0.0, ROUTER_FALLBACK_S + 0.5 - (time.monotonic() - stopped_at)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _tokens(gateway, 4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no answer within 1 s" in err.value.details()
        assert (
            f"longer than the {ROUTER_FALLBACK_S} s this gateway routes on its last known workers"
            in err.value.details()
        )
    finally:
        os.killpg(router_pid, signal.SIGCONT)

    # Back: the workers' leases lapsed meanwhile, so they register again; then requests route as before.
    for _ in range(300):
        try:
            if await _tokens(gateway, 64) == expected:
                break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
        await asyncio.sleep(0.1)
    assert await _tokens(gateway, 64) == expected
    assert await _live_decode_workers(router) == set(DECODE)
    await _no_leaks(mesh)
