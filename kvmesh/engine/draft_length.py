"""How many drafts to ask for, per sequence and step: as many as pay for themselves.

A verify step costs more with every draft it checks (a row more to verify, a step more
of a draft head), and gains only what gets accepted. Model: a draft is accepted with
probability ``a`` given that the one before it was (a chain stops at its first miss), so
k drafts yield on average ``(1 - a**(k + 1)) / (1 - a)`` tokens (the bonus token
included) for ``1 + cost * k`` decode steps' time; the policy picks the k that gives the
most tokens per unit of time. ``cost`` is each draft's price as a share of a decode step:
on the 2-core dev machine about 0.15 (SmolLM2-135M fp32, batch 1: a decode step 33.8 ms,
a verify of 4 drafts 54.9 ms with the EAGLE head's drafting); 0 keeps k at its maximum.

``a`` is estimated per sequence from its own verifies (accepted drafts against misses),
starting from the engine-wide rate so a new request begins where the traffic is. At
least one draft is always asked for: with none, the estimate could never recover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How many verifies the engine-wide rate counts as when a sequence has few of its own.
PRIOR_WEIGHT = 4.0


def tokens_per_step(a: float, k: int) -> float:
    """Mean tokens a verify of k chained drafts yields, each accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_length(a: float, max_k: int, cost: float) -> int:
    """The k in 1..max_k that yields the most tokens per unit of step time."""
    return max(range(1, max_k + 1), key=lambda k: (tokens_per_step(a, k) / (1.0 + cost * k), -k))


@dataclass
class DraftLengthPolicy:
    max_k: int
    cost: float
    # Engine-wide counts (accepted drafts, verifies that ended in a miss), from a 1:1 prior.
    accepted: float = field(default=1.0)
    missed: float = field(default=1.0)

    def choose(self, accepted: int, missed: int, room: int) -> int:
        """Drafts to ask of a sequence that has had ``accepted`` drafts accepted and ``missed``
        verifies end in a miss, with ``room`` tokens left under its limits."""
        k_max = min(self.max_k, room)
        if k_max < 1 or self.cost <= 0:
            return k_max
        prior = self.accepted / (self.accepted + self.missed)
        a = (accepted + PRIOR_WEIGHT * prior) / (accepted + missed + PRIOR_WEIGHT)
        return best_length(a, k_max, self.cost)

    def record(self, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` drafts accepted ``accepted`` of them."""
        self.accepted += accepted
        self.missed += accepted < proposed
