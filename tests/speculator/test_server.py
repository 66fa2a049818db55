"""The speculator service over real gRPC, started in-process."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from services.speculator import main
from tests.service_helpers import serve_main

from .conftest import ProposeStream, batch, eventually, finished, update

LOOP = [11, 12, 13, 14, 15, 16]


async def stats(stub) -> speculator_pb2.StatsResponse:
    return await stub.Stats(speculator_pb2.StatsRequest())


async def test_one_stream_carries_interleaved_requests(stub):
    s = ProposeStream(stub)
    a = [1, 2] + LOOP + LOOP[:2]
    b = [90, 91, 92, 93, 90, 91]
    s.send(update("a", a, len(a), k=3), update("b", b, len(b), k=2))
    ra, rb = await s.recv(), await s.recv()
    assert (ra.request_id, ra.context_length, list(ra.draft_token_ids)) == ("a", 10, LOOP[2:5])
    assert (rb.request_id, rb.context_length, list(rb.draft_token_ids)) == ("b", 6, [92, 93])
    assert ra.timings.compute_ns > 0

    # Only new tokens from now on; an update asking for no drafts gets no answer.
    s.send(update("b", [92], 7), update("a", LOOP[2:4], 12, k=2, accepted=2), update("b", [93], 8, k=3))
    ra, rb = await s.recv(), await s.recv()
    assert (ra.request_id, ra.context_length, list(ra.draft_token_ids)) == ("a", 12, LOOP[4:6])
    assert (rb.request_id, rb.context_length, list(rb.draft_token_ids)) == ("b", 8, [90, 91, 92])

    st = await stats(stub)
    assert (st.proposed_tokens, st.accepted_tokens, st.active_requests) == (3 + 2 + 2 + 3, 2, 2)
    s.send(finished("a", learn=False), finished("b", learn=False))
    await eventually(lambda: _active_is(stub, 0))
    await s.close()


async def test_a_batch_is_answered_in_one_message(stub):
    s = ProposeStream(stub)
    s.send(update("old", LOOP, 6))
    context = LOOP + LOOP[:3]
    s.send(
        batch(
            update("a", context, 9, k=3),
            update("b", [1, 2, 3], 3),  # learns only
            update("c", list(range(50, 60)), 10, k=2),  # nothing to propose: an empty draft
            update("late", context, 9, k=3, deadline_us=1),  # no draft at all
            finished=[finished("old", learn=False).finished],
        )
    )
    r = await s.recv()
    assert [(d.request_id, d.context_length, list(d.token_ids)) for d in r.drafts] == [
        ("a", 9, LOOP[3:6]),
        ("c", 10, []),
    ]
    assert r.request_id == "" and r.timings.compute_ns > 0
    st = await stats(stub)
    assert (st.active_requests, st.proposed_tokens) == (4, 3)

    # A sequence's last tokens and its end in one batch: the tokens are learned too.
    s.send(batch(update("a", [LOOP[3]], 10), finished=[finished("a").finished]))
    await eventually(lambda: _indexed_is(stub, 10))
    await s.close()


async def test_an_update_with_nothing_to_propose_gets_an_empty_answer(stub):
    s = ProposeStream(stub)
    s.send(update("r", list(range(100, 120)), 20, k=4))
    r = await s.recv()
    assert (r.request_id, r.context_length, list(r.draft_token_ids)) == ("r", 20, [])
    await s.close()


async def test_a_passed_deadline_gets_no_answer(speculator, stub):
    s = ProposeStream(stub)
    context = LOOP * 3
    # 1 µs cannot be met; the next update (no deadline) is answered, so the first was skipped.
    s.send(update("late", context, len(context), k=4, deadline_us=1), update("on-time", context, len(context), k=4))
    r = await s.recv()
    assert r.request_id == "on-time"
    assert (await stats(stub)).proposed_tokens == 4
    assert _metric(speculator.metrics_port, "kvmesh_speculator_late_drafts_total") == 1
    await s.close()


async def test_finished_requests_teach_other_streams(stub):
    text = list(range(400, 460))
    first = ProposeStream(stub)
    first.send(update("a", text[:40], 40), update("a", text[40:], 60), finished("a", learn=True))
    await first.close()
    await eventually(lambda: _indexed_is(stub, 60))

    second = ProposeStream(stub)
    context = [7, 7] + text[20:30]
    second.send(update("b", context, len(context), k=5))
    assert list((await second.recv()).draft_token_ids) == text[30:35]
    await second.close()


async def test_a_stream_that_ends_leaves_no_state(stub):
    s = ProposeStream(stub)
    s.send(update("x", LOOP, 6), update("y", LOOP, 6, k=1))
    await s.recv()
    assert (await stats(stub)).active_requests == 2
    await s.close()
    await eventually(lambda: _active_is(stub, 0))

    cancelled = ProposeStream(stub)
    cancelled.send(update("z", LOOP, 6, k=1))
    await cancelled.recv()
    cancelled.call.cancel()
    await eventually(lambda: _active_is(stub, 0))


async def test_a_malformed_update_ends_the_stream_with_invalid_argument(stub):
    s = ProposeStream(stub)
    s.send(update("ok", LOOP, 6), update("bad", [1, 2, 3], 2, k=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.recv()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context_length 2 is less than the 3 tokens sent" in err.value.details()
    await eventually(lambda: _active_is(stub, 0))


async def test_shutdown_ends_open_streams_instead_of_waiting_out_the_grace_period():
    async with serve_main("speculator", main, ["--grace-seconds", "600"]) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            s = ProposeStream(speculator_pb2_grpc.SpeculatorServiceStub(channel))
            s.send(update("r", LOOP, 6, k=1))
            await s.recv()
            await rt.stop()
            # Ended by the server's drain, cleanly: not cancelled by a grace timeout.
            assert await s.call.read() is grpc.aio.EOF
            assert await s.call.code() == grpc.StatusCode.OK


async def test_flags_reach_the_core():
    argv = ["--max-draft-tokens", "2", "--prompt-ngram-sizes", "3", "--suffix-capacity-tokens", "50"]
    async with serve_main("speculator", main, argv) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            s = ProposeStream(speculator_pb2_grpc.SpeculatorServiceStub(channel))
            # Only 3-grams count, and at most 2 tokens come back.
            s.send(update("two", [5, 6, 9, 5, 6], 5, k=4), update("three", LOOP + LOOP[:3], 9, k=4))
            assert list((await s.recv()).draft_token_ids) == []
            assert list((await s.recv()).draft_token_ids) == LOOP[3:5]
            await s.close()


async def _active_is(stub, n: int) -> bool:
    return (await stats(stub)).active_requests == n


async def _indexed_is(stub, n: int) -> bool:
    return (await stats(stub)).indexed_tokens == n


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
