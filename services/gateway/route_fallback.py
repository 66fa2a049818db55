"""Routing while the router is unreachable: the decode workers it named recently, for a bounded time.

Every plan the router returns teaches this which decode workers are alive
(each remembered with when it was last named). When the router cannot be
asked (``RouterUnreachable``: down, or silent past the Route deadline), a
request goes to one of those workers, round-robin, excluding the ones that
failed it already, and is prefilled there (``prefill_locally``: no prefill
worker and no KV hand-off needed, so the fewest peers that could fail). Cache
awareness and load balancing are lost meanwhile; serving is not.

The bound: only workers named within ``hold_s`` of the router's last answer,
and only until ``hold_s`` after it. A router gone longer than that may have
dropped workers this gateway cannot know about, so requests then fail with a
clear UNAVAILABLE naming the outage, as they do with no router at all.
A dead worker still in the set fails its request, which is retried (or
migrated) elsewhere as always.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from kvmesh.api.common.v1 import worker_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import Unavailable
from services.gateway.backends import RouterUnreachable

DEFAULT_HOLD_S = 30.0


class LastKnownWorkers:
    def __init__(self, hold_s: float = DEFAULT_HOLD_S, now: Callable[[], float] = time.monotonic) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self._now = now
        self._decode: dict[str, tuple[worker_pb2.WorkerEndpoint, float]] = {}  # worker id -> (endpoint, named at)
        self._last_answer: float | None = None
        self._turn = itertools.count()

    def learn(self, plan: router_pb2.RouteResponse) -> None:
        """The router answered with ``plan``."""
        now = self._now()
        self._last_answer = now
        worker = worker_pb2.WorkerEndpoint()
        worker.CopyFrom(plan.decode_worker)
        self._decode[worker.worker_id] = (worker, now)

    def plan(self, request: router_pb2.RouteRequest, cause: RouterUnreachable) -> router_pb2.RouteResponse:
        """A plan without the router, or Unavailable once its outage outlasted ``hold_s``."""
        now = self._now()
        if self._last_answer is None or now - self._last_answer > self.hold_s:
            since = (
                "no known workers to route on without it (no answer since this gateway started)"
                if self._last_answer is None
                else (
                    f"no answer for {now - self._last_answer:.0f} s, longer than the {self.hold_s:g} s "
                    "this gateway routes on its last known workers"
                )
            )
            raise Unavailable(f"{cause.message}; {since}")
        excluded = set(request.exclude_worker_ids)
        known = sorted(
            (w for w, named in self._decode.values() if self._last_answer - named <= self.hold_s),
            key=lambda w: w.worker_id,
        )
        candidates = [w for w in known if w.worker_id not in excluded]
        if not candidates:
            raise Unavailable(f"{cause.message}; none of the decode workers it last named is left to try")
        return router_pb2.RouteResponse(
            decode_worker=candidates[next(self._turn) % len(candidates)], prefill_locally=True
        )
