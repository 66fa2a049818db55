"""Workers this gateway could not reach lately, left out of its routes for a while.

The router routes by what the workers tell it. A worker that still reaches the router but not this
gateway (a partition between the two hosts alone) keeps being routed here, and each such request waits
for a keepalive or deadline to fail the call before it is retried elsewhere. So a worker whose call
failed is left out of this gateway's routes (its id joins the route's exclusions) for ``hold_s``, twice
as long each time it fails again, at most ``max_hold_s``; a call it serves forgets it. Leaving them out
never costs a request: when nobody else is left, the gateway routes as if it avoided no one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_HOLD_S = 5.0
DEFAULT_MAX_HOLD_S = 60.0


class AvoidedWorkers:
    def __init__(
        self,
        hold_s: float = DEFAULT_HOLD_S,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hold_s, self.max_hold_s = hold_s, max_hold_s
        self._now = now
        self._until: dict[str, tuple[float, float]] = {}  # worker id -> (avoided until, its last hold)

    def failed(self, worker_id: str) -> None:
        """A call to ``worker_id`` failed (unreachable, timed out, stream broke)."""
        now = self._now()
        until, last = self._until.get(worker_id, (0.0, 0.0))
        hold = min(2 * last, self.max_hold_s) if until > now - last else self.hold_s
        self._until[worker_id] = (now + hold, hold)

    def served(self, *worker_ids: str) -> None:
        """Calls to these workers succeeded."""
        for w in worker_ids:
            self._until.pop(w, None)

    def avoided(self) -> list[str]:
        now = self._now()
        return sorted(w for w, (until, _) in self._until.items() if until > now)
