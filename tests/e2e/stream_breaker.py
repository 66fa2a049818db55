"""Breaking a decode worker (freezing it, cutting its host off the network) in the middle of a stream.

The tiny model streams a request's hundreds of tokens in well under a second, so a thread watches for the
worker and acts itself instead of handing it back to the event loop: it finds the worker from the
active-request gauges (the only request in flight), then breaks it the moment the client's messages so
far show the stream under way, so the gateway has tokens to resume after.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.launcher.supervisor import Mesh
from tests.e2e.mesh_helpers import metrics, poll

STREAMED_BEFORE_STOP = 3  # messages the client has (the first token from prefill, then decode's) at the break
BREAK_ATTEMPTS = 5  # streams started until one is still running when its worker is broken
CUT_GRACE_S = 1.0  # a stream that had ended reaches the client within this; a cut one waits on its worker


def streaming(mesh: Mesh, worker: str) -> bool:
    """Whether ``worker`` holds a request; a worker restarting (or cut off) holds none as far as we see."""
    try:
        return metrics(mesh, worker)["kvmesh_decode_active_requests"] > 0
    except OSError:
        return False


async def read_into(call, received: list) -> list[gateway_pb2.GenerateResponse]:
    while (msg := await call.read()) != grpc.aio.EOF:
        received.append(msg)
    return received


class _Breaker(threading.Thread):
    def __init__(self, mesh: Mesh, workers: Sequence[str], received: list, act: Callable[[str], None]) -> None:
        super().__init__(daemon=True)
        self.mesh, self.workers, self.received, self.act = mesh, workers, received, act
        self.victim: str | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 30
        while self.victim is None and time.monotonic() < deadline:
            for w in self.workers:
                if streaming(self.mesh, w):
                    while len(self.received) < STREAMED_BEFORE_STOP and time.monotonic() < deadline:
                        time.sleep(0.001)
                    self.act(w)
                    self.victim = w
                    break

    def broken(self) -> str:
        """The broken worker, once the thread has ended (returned or raised; either way within its deadline)."""
        self.join(60)
        assert self.victim is not None, "no decode worker was seen streaming the request"
        return self.victim


async def break_mid_stream(
    mesh: Mesh,
    gateway,
    request: gateway_pb2.GenerateRequest,
    workers: Sequence[str],
    act: Callable[[str], None],
    undo: Callable[[str], None],
) -> tuple[asyncio.Future, str, str]:
    """Start ``request``, then ``act`` on the one of ``workers`` streaming it. A stream can end between the
    gauge's read and the act landing; then ``undo`` (the worker serves again) and the request is sent again.
    Returns the client's reader (it resolves to every message the client got), the victim, and the trace id
    the broken request ran in."""
    for _ in range(BREAK_ATTEMPTS):
        # The last request's worker lets go a moment after its client is done; until then it would look
        # like the one streaming this request.
        idle = await asyncio.to_thread(poll, lambda: [streaming(mesh, w) for w in workers], lambda s: not any(s))
        assert not any(idle), f"decode workers still streaming before the request: {idle}"
        received: list[gateway_pb2.GenerateResponse] = []
        breaker = _Breaker(mesh, workers, received, act)
        breaker.start()
        trace_id = secrets.token_hex(16)
        traceparent = (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)
        reader = asyncio.ensure_future(read_into(gateway.Generate(request, metadata=traceparent), received))
        victim = await asyncio.to_thread(breaker.broken)
        finished, _ = await asyncio.wait({reader}, timeout=CUT_GRACE_S)
        if not finished:
            return reader, victim, trace_id  # the client waits on the broken worker: the stream is cut
        undo(victim)  # it had finished first: go again
        reader.result()  # unless it failed outright: that is the test's failure, not a retry
    raise AssertionError(f"every one of {BREAK_ATTEMPTS} streams ended before its worker was broken")
