"""Workers the gateway could not reach lately are left out of its routes for a while, never at a request's cost."""

from __future__ import annotations

from services.gateway.avoided_workers import AvoidedWorkers
from tests.gateway.fakes import DECODE_TOKENS, FIRST_TOKEN, FakeMesh
from tests.gateway.helpers import collect, make_gateway, request


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_failed_worker_is_avoided_for_a_hold_that_doubles_while_it_keeps_failing() -> None:
    clock = Clock()
    avoided = AvoidedWorkers(hold_s=5, max_hold_s=12, now=clock)
    avoided.failed("d0")
    assert avoided.avoided() == ["d0"]
    clock.t += 5.1
    assert avoided.avoided() == []
    avoided.failed("d0")  # failed again soon after: twice as long
    clock.t += 9.9
    assert avoided.avoided() == ["d0"]
    clock.t += 0.2
    avoided.failed("d0")  # and again: at most max_hold_s
    clock.t += 11.9
    assert avoided.avoided() == ["d0"]
    avoided.served("d0")  # it answered: forgotten
    assert avoided.avoided() == []
    avoided.failed("d0")
    clock.t += 5.1
    assert avoided.avoided() == []  # a fresh failure starts again at hold_s


def test_a_failure_long_after_the_last_starts_again_at_the_first_hold() -> None:
    clock = Clock()
    avoided = AvoidedWorkers(hold_s=5, max_hold_s=60, now=clock)
    avoided.failed("d0")
    clock.t += 30
    avoided.failed("d0")
    clock.t += 5.1
    assert avoided.avoided() == []


async def test_the_next_request_leaves_out_the_worker_the_last_one_could_not_reach(model) -> None:
    mesh = FakeMesh()
    mesh.fail_decode_at["d0"] = 0  # every call to d0 fails before its first token
    gateway = make_gateway(model, mesh)
    await collect(gateway, request())
    mesh.routes.clear()

    chunks = await collect(gateway, request())

    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]
    assert [list(r.exclude_worker_ids) for r in mesh.routes] == [["d0"]]  # asked once, without d0
    assert [w for w, _ in mesh.decodes][-1] == "d1"


async def test_when_only_avoided_workers_are_left_the_request_is_routed_to_them_anyway(model) -> None:
    mesh = FakeMesh()
    mesh.decode_workers = ["d0"]
    avoided = AvoidedWorkers()
    gateway = make_gateway(model, mesh, avoided_workers=avoided)
    avoided.failed("d0")  # as a failed call would have

    chunks = await collect(gateway, request())

    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]
    assert [list(r.exclude_worker_ids) for r in mesh.routes] == [["d0"], []]
    assert avoided.avoided() == []  # it served: forgotten
