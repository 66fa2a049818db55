"""The router unreachable: requests go to the decode workers it named last, for a bounded time, then UNAVAILABLE."""

from __future__ import annotations

import pytest

from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import Unavailable
from services.gateway.avoided_workers import AvoidedWorkers
from services.gateway.backends import RouterUnreachable
from services.gateway.route_fallback import LastKnownWorkers
from tests.gateway.fakes import DECODE_TOKENS, FIRST_TOKEN, FakeMesh, endpoint
from tests.gateway.helpers import collect, make_gateway, request, sample

TOKENS = [FIRST_TOKEN, *DECODE_TOKENS]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _gateway(model, mesh: FakeMesh, clock: Clock):
    return make_gateway(
        model, mesh, known_workers=LastKnownWorkers(30.0, now=clock), avoided_workers=AvoidedWorkers(now=clock)
    )


async def _learned_both(gateway, mesh: FakeMesh, clock: Clock) -> None:
    """Two requests while the router is up: it names d0, then d1 (d0 is excluded after failing); then long
    enough that the gateway no longer avoids d0."""
    await collect(gateway, request())
    mesh.dead.add("d0")
    await collect(gateway, request())
    mesh.dead.clear()
    clock.t += 10


async def test_a_down_router_is_stood_in_for_by_its_last_known_workers_with_local_prefill(model) -> None:
    mesh, clock = FakeMesh(), Clock()
    gateway = _gateway(model, mesh, clock)
    await _learned_both(gateway, mesh, clock)
    mesh.router_down = True
    clock.t += 19
    decodes_before = len(mesh.decodes)

    for _ in range(2):
        chunks = await collect(gateway, request())
        assert [t for c in chunks for t in c.token_ids] == TOKENS

    served = mesh.decodes[decodes_before:]
    assert sorted(w for w, _ in served) == ["d0", "d1"]  # round-robin over what the router named
    assert all(r.WhichOneof("prefill") == "local" for _, r in served)
    assert sample(gateway, "kvmesh_gateway_router_fallbacks_total") == 2
    assert mesh.leases == set()


async def test_a_known_worker_that_fails_is_skipped_during_the_outage(model) -> None:
    mesh, clock = FakeMesh(), Clock()
    gateway = _gateway(model, mesh, clock)
    await _learned_both(gateway, mesh, clock)
    mesh.router_down = True
    mesh.dead.add("d0")

    for _ in range(2):
        assert [t for c in await collect(gateway, request()) for t in c.token_ids] == TOKENS
    mesh.decode_workers = ["d0"]  # the router drops d1 from now on, but it is down: the gateway keeps it
    assert [t for c in await collect(gateway, request()) for t in c.token_ids] == TOKENS
    mesh.dead.add("d1")  # and now both: d1 fails, then d0, which the gateway had left out while it could
    with pytest.raises(Unavailable, match="d0 .* failed: unreachable: connection refused .after a retry"):
        await collect(gateway, request())


async def test_past_the_bound_the_outage_gives_a_clear_unavailable(model) -> None:
    mesh, clock = FakeMesh(), Clock()
    gateway = make_gateway(model, mesh, known_workers=LastKnownWorkers(30.0, now=clock))
    await collect(gateway, request())
    mesh.router_down = True
    clock.t += 31

    with pytest.raises(Unavailable) as info:
        await collect(gateway, request())

    assert info.value.message == (
        "router (r:1) unreachable: connection refused; no answer for 31 s, longer than the 30 s "
        "this gateway routes on its last known workers"
    )
    assert gateway.inflight == 0

    mesh.router_down = False  # back: routing as before, and the bound starts over
    assert [t for c in await collect(gateway, request()) for t in c.token_ids] == TOKENS


def test_with_every_known_worker_excluded_there_is_none_to_try() -> None:
    known = LastKnownWorkers(30.0, now=Clock())
    known.learn(router_pb2.RouteResponse(decode_worker=endpoint("d0")))
    cause = RouterUnreachable("router (r:1) unreachable: connection refused")

    assert known.plan(router_pb2.RouteRequest(), cause).decode_worker.worker_id == "d0"
    with pytest.raises(Unavailable, match="none of the decode workers it last named is left to try"):
        known.plan(router_pb2.RouteRequest(exclude_worker_ids=["d0"]), cause)
