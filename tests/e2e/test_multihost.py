"""The mesh across hosts: every process on a host of its own (a network namespace on a bridge), hosts cut off.

A partition is not a crash: the processes on the host keep running and nothing closes a socket, so only
keepalives, deadlines and leases can tell. A decode host cut off mid-stream: the gateway moves the stream
to the other decode worker (the client sees the same tokens), and once the link is back the cut-off worker
has let go of the stream its gateway abandoned. A host that returns after its router lease expired is
routed to only after it registered again. A link that resets every connection (Toxiproxy in front of the
prefill worker) costs a retry, not the request.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.api.common.v1 import sampling_pb2, worker_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.launcher.multihost import HostedMesh
from kvmesh.launcher.netns import can_make_hosts
from kvmesh.runtime import create_channel
from kvmesh.sampling import SamplingParams
from tests.e2e.mesh_helpers import held, mesh_options, metrics, poll
from tests.e2e.stream_breaker import break_mid_stream, read_into

NO_HOSTS = can_make_hosts()
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.skipif(bool(NO_HOSTS), reason=NO_HOSTS or "")]

DECODE = ("decode-0", "decode-1")
PROMPT = list(range(60, 100))
MAX_TOKENS = 460  # all the tiny model's context allows: a stream long enough to cut in the middle
LEASE_TTL_MS = 3000  # the router's: a cut-off worker leaves routing this long after its last heartbeat


@pytest.fixture(scope="module")
def hosted(e2e_model, tmp_path_factory):
    """Every process on its own host; the prefill worker's peers reach it through a Toxiproxy on its host."""
    options = mesh_options(e2e_model, decode_workers=2, role_env={"router": {"KVMESH_LEASE_TTL_MS": str(LEASE_TTL_MS)}})
    m = HostedMesh.plan(options, tmp_path_factory.mktemp("multihost"))
    try:
        m.behind_proxy("prefill-0")
    except BaseException:
        m.stop()
        raise
    with m:
        yield m


@pytest.fixture(scope="module")
def reference(e2e_model):
    """Greedy tokens as one engine in this process gives them."""
    engine = LLMEngine(e2e_model, EngineConfig(num_blocks=64))

    def tokens(prompt: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return engine.generate([prompt], params)[0].token_ids

    return tokens


@pytest.fixture
async def stubs(hosted):
    mesh = hosted.mesh
    async with (
        grpc.aio.insecure_channel(mesh.address("gateway")) as gch,
        create_channel(mesh.address("router"), mesh.identity("operator")) as rch,
    ):
        yield gateway_pb2_grpc.GatewayServiceStub(gch), router_pb2_grpc.RouterServiceStub(rch)


def _request(prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def _tokens(messages: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def _routed_decode_workers(router) -> set[str]:
    resp = await router.ListWorkers(router_pb2.ListWorkersRequest(role=worker_pb2.WORKER_ROLE_DECODE))
    return {w.endpoint.worker_id for w in resp.workers}


async def _wait_routed(router, want: set[str]) -> None:
    for _ in range(600):
        if await _routed_decode_workers(router) == want:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the router routes to {await _routed_decode_workers(router)}, not {want}")


def _link_event(hosted: HostedMesh, worker: str, event: str) -> float:
    return metrics(hosted.mesh, worker).get(f"kvmesh_router_link_events_total{{event={event}}}", 0)


async def test_a_decode_host_cut_off_mid_stream_is_invisible_to_the_client(hosted, stubs) -> None:
    gateway, router = stubs
    network = hosted.network
    expected = await read_into(gateway.Generate(_request()), [])  # greedy: the text any healthy worker gives
    migrated = metrics(hosted.mesh, "gateway").get("kvmesh_gateway_migrations_total{outcome=resumed}", 0)

    def cut(worker: str) -> None:
        network.cut(hosted.host_of(worker))

    def heal(worker: str) -> None:
        network.heal(hosted.host_of(worker))

    reader, victim, _ = await break_mid_stream(hosted.mesh, gateway, _request(), DECODE, cut, heal)
    try:
        got = await asyncio.wait_for(reader, timeout=120)  # a bound against hanging, not speed
    finally:
        heal(victim)

    assert _tokens(got) == _tokens(expected)
    assert "".join(m.text for m in got) == "".join(m.text for m in expected)
    assert got[-1].final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert metrics(hosted.mesh, "gateway")["kvmesh_gateway_migrations_total{outcome=resumed}"] == migrated + 1
    # Back on the network, the victim has let go of the stream nobody reads any more (its keepalive
    # found the gateway's end gone), and nothing else is held anywhere.
    left = await asyncio.to_thread(
        poll, lambda: held(hosted.mesh, ["prefill-0"], DECODE), lambda h: not any(h.values()), 300
    )
    assert not any(left.values()), left
    await _wait_routed(router, set(DECODE))


async def test_a_host_back_after_its_lease_expired_is_routed_to_only_once_registered_again(hosted, stubs) -> None:
    gateway, router = stubs
    network, victim = hosted.network, "decode-1"
    await _wait_routed(router, set(DECODE))
    served_before = metrics(hosted.mesh, victim)["kvmesh_decode_requests_total"]
    registrations = _link_event(hosted, victim, "registrations")

    network.cut(hosted.host_of(victim))
    try:
        await _wait_routed(router, {"decode-0"})  # its lease lapsed: out of routing
        # Meanwhile every request is served, by the worker still on the network.
        for i in range(3):
            got = await read_into(gateway.Generate(_request([7 + i, *PROMPT], 8)), [])
            assert len(_tokens(got)) == 8
    finally:
        network.heal(hosted.host_of(victim))
    await _wait_routed(router, set(DECODE))

    # It is routed to again because it registered again (its old lease was refused), and nothing reached it
    # between the heal and that registration.
    assert _link_event(hosted, victim, "leases_lost") >= 1
    assert _link_event(hosted, victim, "registrations") == registrations + 1
    assert metrics(hosted.mesh, victim)["kvmesh_decode_requests_total"] == served_before
    # And it serves: fresh prompts spread over both workers. Sent for up to 20 s, past the gateway's hold on a
    # worker it failed to reach (5 s), should a first call to the returning host have failed.
    loop = asyncio.get_running_loop()
    deadline, i = loop.time() + 20, 0
    while metrics(hosted.mesh, victim)["kvmesh_decode_requests_total"] == served_before and loop.time() < deadline:
        await read_into(gateway.Generate(_request([40 + i % 50, 41 + i % 50, *PROMPT], 4)), [])
        i += 1
    gateway_metrics = metrics(hosted.mesh, "gateway")
    retries = {k: v for k, v in gateway_metrics.items() if k.startswith("kvmesh_gateway_retries_total")}
    assert metrics(hosted.mesh, victim)["kvmesh_decode_requests_total"] > served_before, (i, retries)


async def test_a_prefill_link_resetting_every_connection_costs_a_retry_not_the_request(
    hosted, stubs, reference
) -> None:
    gateway, _ = stubs
    (proxy,) = hosted.proxies
    retries = _retries(hosted)
    toxic = proxy.add_toxic("prefill-0", "reset_peer", timeout=0)
    try:
        prompt = [9, 8, 7, *PROMPT]
        got = await read_into(gateway.Generate(_request(prompt, 16)), [])
    finally:
        proxy.remove_toxic("prefill-0", toxic)
    # The gateway's Prefill call was reset; it routed the request again, without that worker, and the
    # decode worker computed the prompt itself: the same tokens.
    assert _tokens(got) == reference(prompt, 16)
    assert _retries(hosted) > retries
    # Once the link is clean again, prefill-0 serves hand-offs again (the gateway reconnects within 2 s).
    prompt = [6, 5, 4, *PROMPT]
    served = metrics(hosted.mesh, "prefill-0")["kvmesh_prefill_requests_total"]
    for attempt in range(50):
        got = await read_into(gateway.Generate(_request([attempt, *prompt], 4)), [])
        if metrics(hosted.mesh, "prefill-0")["kvmesh_prefill_requests_total"] > served:
            break
        await asyncio.sleep(0.1)
    assert metrics(hosted.mesh, "prefill-0")["kvmesh_prefill_requests_total"] > served
    assert _tokens(got) == reference([attempt, *prompt], 4)


def _retries(hosted: HostedMesh) -> float:
    found = metrics(hosted.mesh, "gateway")
    return sum(v for k, v in found.items() if k.startswith("kvmesh_gateway_retries_total"))
