"""How many drafts to ask for, per sequence and step: as many as pay for themselves.

A verify step costs more with every draft it checks (a row more to verify, a step more
of a draft head), and gains only what gets accepted. Model: a draft is accepted with
probability ``a`` given that the one before it was (a chain stops at its first miss), so
k drafts yield on average ``(1 - a**(k + 1)) / (1 - a)`` tokens (the bonus token
included), and a verify of k drafts takes ``costs[k - 1]`` decode steps' time; the
policy picks the k that gives the most tokens per unit of time. Past the table, each
draft costs what the last one in it did; an empty table makes drafts free (always k).

The price depends on the batch: a verify adds k rows per sequence, and the more sequences,
the less of a step is the weights' streaming that extra rows get for free; so the table is
kept per batch size (``verify_cost`` measures 1 and 8 on CPU).

``a`` is estimated per sequence from its own verifies (accepted drafts against misses),
starting from the engine-wide rate so a new request begins where the traffic is. At
least one draft is always asked for: with none, the estimate could never recover.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# How many verifies the engine-wide rate counts as when a sequence has few of its own.
PRIOR_WEIGHT = 4.0


def tokens_per_step(a: float, k: int) -> float:
    """Mean tokens a verify of k chained drafts yields, each accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def step_cost(costs: Sequence[float], k: int) -> float:
    """A verify of k drafts in decode steps' time (``costs[k - 1]``; extrapolated past the table)."""
    if k == 0 or not costs:
        return 1.0
    if k <= len(costs):
        return costs[k - 1]
    last = costs[-1] - (costs[-2] if len(costs) > 1 else 1.0)
    return costs[-1] + last * (k - len(costs))


def best_length(a: float, max_k: int, costs: Sequence[float]) -> int:
    """The k in 1..max_k that yields the most tokens per unit of step time (the smaller on a tie)."""
    return max(range(1, max_k + 1), key=lambda k: (tokens_per_step(a, k) / step_cost(costs, k), -k))


@dataclass
class DraftLengthPolicy:
    max_k: int
    # The cost table per batch size it was measured at (at least 1): a step of n decoding
    # sequences is priced by the table of the largest size <= n.
    costs: dict[int, tuple[float, ...]]
    # Engine-wide counts (accepted drafts, verifies that ended in a miss), from a 1:1 prior.
    accepted: float = 1.0
    missed: float = 1.0

    def costs_at(self, batch: int) -> tuple[float, ...]:
        return self.costs[max((b for b in self.costs if b <= batch), default=min(self.costs))]

    def choose(self, accepted: int, missed: int, room: int, batch: int = 1) -> int:
        """Drafts to ask of a sequence that has had ``accepted`` drafts accepted and ``missed``
        verifies end in a miss, with ``room`` tokens left under its limits, in a step of
        ``batch`` decoding sequences."""
        k_max = min(self.max_k, room)
        costs = self.costs_at(batch)
        if k_max < 1 or not costs:
            return k_max
        prior = self.accepted / (self.accepted + self.missed)
        a = (accepted + PRIOR_WEIGHT * prior) / (accepted + missed + PRIOR_WEIGHT)
        return best_length(a, k_max, costs)

    def record(self, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` drafts accepted ``accepted`` of them."""
        self.accepted += accepted
        self.missed += accepted < proposed


def parse_draft_costs(text: str | None) -> tuple[float, ...] | None:
    """``"1.2,1.3"`` -> (1.2, 1.3); ``"free"`` -> () (always k drafts); None -> None (the default)."""
    if text is None:
        return None
    if text.strip() == "free":
        return ()
    costs = tuple(float(x) for x in text.split(","))
    if any(c < 1.0 for c in costs) or list(costs) != sorted(costs):
        raise ValueError(f"draft costs must be >= 1 and non-decreasing, got {text!r}")
    return costs
