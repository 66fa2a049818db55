"""When a crashed process is started again: exponential backoff, and a crash-loop limit that gives up.

Pure bookkeeping (the supervisor does the starting), so the decisions are
tested with a fake clock:

- a process that exits without being stopped is restarted after
  ``initial_backoff_s``, then twice that, ... up to ``max_backoff_s``;
- a run that lasted ``stable_after_s`` counts as healthy: the next crash starts
  the backoff over;
- after ``max_restarts`` restarts in a row that each crashed before becoming
  stable, the process is in a crash loop (a missing model, a port taken, a
  bad flag): restarting it again would only spin, so the supervisor gives up
  and says so.

This is what Docker's restart policy does for the compose file
(``restart: on-failure`` with ``max_attempts`` and its own doubling delay).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    max_restarts: int = 5
    stable_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s or self.multiplier < 1:
            raise ValueError(f"bad backoff: {self}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def backoff_s(self, restarts_in_a_row: int) -> float:
        """The wait before restart number ``restarts_in_a_row + 1`` of a crash streak."""
        return min(self.initial_backoff_s * self.multiplier**restarts_in_a_row, self.max_backoff_s)


@dataclass
class CrashRecord:
    """One process's crash streak as the supervisor tracks it."""

    started_at: float
    restarts_in_a_row: int = 0
    total_restarts: int = 0
    gave_up: bool = False

    def crashed(self, policy: RestartPolicy, now: float) -> float | None:
        """A crash at ``now``: the delay before restarting it, or None (a crash loop: give up)."""
        if now - self.started_at >= policy.stable_after_s:
            self.restarts_in_a_row = 0  # it ran long enough to count as healthy: a new streak
        if self.restarts_in_a_row >= policy.max_restarts:
            self.gave_up = True
            return None
        return policy.backoff_s(self.restarts_in_a_row)

    def restarted(self, now: float) -> None:
        self.started_at = now
        self.restarts_in_a_row += 1
        self.total_restarts += 1
