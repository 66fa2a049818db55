"""A dead or broken worker: one retry elsewhere before the first token, UNAVAILABLE after; no lease left behind."""

from __future__ import annotations

import pytest

from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.errors import InvalidArgument, Unavailable
from services.gateway.migration import MigrationPolicy
from tests.gateway.fakes import DECODE_TOKENS, FIRST_TOKEN, FakeMesh
from tests.gateway.helpers import PROMPT, collect, make_gateway, request, sample


async def test_a_dead_prefill_worker_is_retried_on_another(model) -> None:
    mesh = FakeMesh()
    mesh.dead.add("p0")
    gateway = make_gateway(model, mesh)

    chunks = await collect(gateway, request())

    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]
    assert [list(r.exclude_worker_ids) for r in mesh.routes] == [[], ["p0"]]
    assert [w for w, _ in mesh.prefills] == ["p0", "p1"]
    assert sample(gateway, "kvmesh_gateway_retries_total", stage="prefill") == 1


async def test_a_decode_worker_dying_before_the_first_token_is_retried_and_its_lease_aborted(model) -> None:
    mesh = FakeMesh()
    mesh.fail_decode_at["d0"] = 0
    gateway = make_gateway(model, mesh)

    chunks = await collect(gateway, request())

    assert [c.offset for c in chunks] == [0, 1, 2, 3]
    assert [w for w, _ in mesh.decodes] == ["d0", "d1"]
    assert list(mesh.routes[1].exclude_worker_ids) == ["d0"]
    await gateway.wait_idle()
    assert mesh.released == [("p0:1", "lease-1", prefill_pb2.LEASE_OUTCOME_ABORT)]
    assert mesh.leases == set()


async def test_a_decode_worker_dying_after_tokens_migrates_the_stream_to_another(model) -> None:
    mesh = FakeMesh()
    mesh.fail_decode_at["d0"] = 2
    gateway = make_gateway(model, mesh)

    chunks = await collect(gateway, request())

    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]  # as if nothing happened
    assert [c.offset for c in chunks] == [0, 1, 2, 3]
    assert "".join(c.text for c in chunks) == "".join(f"<{t}>" for t in [FIRST_TOKEN, *DECODE_TOKENS])
    assert [w for w, _ in mesh.decodes] == ["d0", "d1"]
    again = mesh.decodes[1][1]
    assert again.WhichOneof("prefill") == "local" and list(again.resume_token_ids) == [FIRST_TOKEN, DECODE_TOKENS[0]]
    assert list(again.prompt_token_ids) == PROMPT
    assert list(mesh.routes[1].exclude_worker_ids) == ["d0"]
    usage = chunks[-1].final.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 4)
    assert usage.cached_tokens == 32  # the new worker's prompt hits
    await gateway.wait_idle()
    assert mesh.leases == set() and gateway.inflight == 0
    assert sample(gateway, "kvmesh_gateway_migrations_total", outcome="resumed") == 1
    assert sample(gateway, "kvmesh_gateway_requests_total", method="generate", outcome="ok") == 1


async def test_migrations_stop_at_the_limit_with_unavailable(model) -> None:
    mesh = FakeMesh(decode=("d0", "d1", "d2"))
    mesh.fail_decode_at |= {"d0": 1, "d1": 2, "d2": 3}  # every worker it lands on dies a token later
    gateway = make_gateway(model, mesh, migration=MigrationPolicy(max_migrations=1))
    received = []

    with pytest.raises(Unavailable) as info:
        async for chunk in gateway.generate(request(), "rid"):
            received.append(chunk)

    assert [t for c in received for t in c.token_ids] == [FIRST_TOKEN, DECODE_TOKENS[0]]
    assert (
        "decode worker d1 (d1:1) failed: unreachable: Socket closed after 2 tokens were streamed" in info.value.message
    )
    assert "already moved 1 times (the limit)" in info.value.message
    assert [w for w, _ in mesh.decodes] == ["d0", "d1"]
    await gateway.wait_idle()
    assert mesh.leases == set() and gateway.inflight == 0
    assert sample(gateway, "kvmesh_gateway_migrations_total", outcome="limit") == 1
    assert sample(gateway, "kvmesh_gateway_requests_total", method="generate", outcome="unavailable") == 1


async def test_no_decode_worker_left_to_migrate_to_names_the_failure(model) -> None:
    mesh = FakeMesh(decode=("d0",))
    mesh.fail_decode_at["d0"] = 2
    gateway = make_gateway(model, mesh)

    with pytest.raises(Unavailable) as info:
        await collect(gateway, request())

    assert info.value.message == (
        "decode worker d0 (d0:1) failed: unreachable: Socket closed after 2 tokens were streamed; "
        "no other worker to resume on: no worker available for this request"
    )
    assert sample(gateway, "kvmesh_gateway_migrations_total", outcome="no_worker") == 1
    assert sample(gateway, "kvmesh_gateway_migrations_total", outcome="resumed") == 0


async def test_two_failed_attempts_give_unavailable(model) -> None:
    mesh = FakeMesh()
    mesh.dead |= {"d0", "d1"}
    gateway = make_gateway(model, mesh)

    with pytest.raises(Unavailable) as info:
        await collect(gateway, request())

    assert (
        info.value.message
        == "decode worker d1 (d1:1) failed: unreachable: connection refused (after a retry on another worker)"
    )
    await gateway.wait_idle()
    assert mesh.leases == set()  # both prefills' leases aborted
    assert len(mesh.released) == 2


async def test_no_other_worker_to_retry_on_names_the_first_failure(model) -> None:
    mesh = FakeMesh(decode=("d0",))
    mesh.dead.add("d0")
    gateway = make_gateway(model, mesh)

    with pytest.raises(Unavailable) as info:
        await collect(gateway, request())

    assert info.value.message == (
        "decode worker d0 (d0:1) failed: unreachable: connection refused; "
        "no other worker to retry on: no worker available for this request"
    )


async def test_a_dead_router_gives_unavailable(model) -> None:
    mesh = FakeMesh()
    mesh.router_down = True
    gateway = make_gateway(model, mesh)

    with pytest.raises(Unavailable, match="router"):
        await collect(gateway, request())
    assert gateway.inflight == 0


async def test_a_workers_own_refusal_reaches_the_client_unchanged(model) -> None:
    mesh = FakeMesh()
    mesh.prefill_error = InvalidArgument("request needs more KV than this worker's pool")
    gateway = make_gateway(model, mesh)

    with pytest.raises(InvalidArgument, match="more KV than this worker's pool"):
        await collect(gateway, request())
    assert len(mesh.routes) == 1  # not a worker failure: no retry


async def test_a_silent_decode_stream_counts_as_failed(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 0
    gateway = make_gateway(model, mesh, stream_idle_timeout_s=0.05)

    chunks = await collect(gateway, request())

    assert [w for w, _ in mesh.decodes] == ["d0", "d1"]
    assert ("decode", "d0") in mesh.cancelled  # the silent stream was closed, not left open
    assert len(chunks) == 4
    assert mesh.open_streams == 0


async def test_a_stream_that_stalls_after_its_first_tokens_migrates_at_the_stall_timeout(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 2  # two tokens, then a hung worker
    gateway = make_gateway(model, mesh, stream_idle_timeout_s=600, token_stall_timeout_s=0.05)

    chunks = await collect(gateway, request())

    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]
    assert [w for w, _ in mesh.decodes] == ["d0", "d1"]
    assert ("decode", "d0") in mesh.cancelled and mesh.open_streams == 0
    assert sample(gateway, "kvmesh_gateway_migrations_total", outcome="resumed") == 1
