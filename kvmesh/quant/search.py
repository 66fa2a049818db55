"""Layer-selective quantization: per-group sensitivity, an additive plan under a bit budget,
then a local search that measures whole configurations.

Sensitivity of a (group, format) = mean KL when only that group is quantized. The additive
planner picks one format per group minimizing the *sum* of sensitivities under the budget
(average stored bits per quantizable weight) - exact, by a Pareto sweep over groups. Sums
assume layers are independent, so they cannot see errors cancel (ModelOpt's auto_quantize has
that limit). The local search therefore measures end-to-end KL of whole configs, tries moving
groups to fewer bits, and keeps a move while the measured KL stays within what the additive plan
promised; every measured config records measured KL beside its sum of parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.checkpoint.compressed import Plan
from kvmesh.checkpoint.formats import UNQUANTIZED_BITS, get_format

Measure = Callable[[Plan], float]  # plan -> mean KL on the search set
KEEP = "bf16"  # a group left unquantized


@dataclass(frozen=True)
class Group:
    name: str
    modules: tuple[str, ...]
    params: int


def layer_groups(modules: Sequence[str], params: Callable[[str], int], layers_per_group: int) -> list[Group]:
    """Attention and MLP projections of each block of ``layers_per_group`` layers."""
    buckets: dict[str, list[str]] = {}
    for m in modules:
        layer = int(m.split(".")[2])
        lo = layer // layers_per_group * layers_per_group
        kind = "attn" if ".self_attn." in m else "mlp"
        buckets.setdefault(f"L{lo}-{lo + layers_per_group - 1}.{kind}", []).append(m)
    return [Group(k, tuple(v), sum(params(m) for m in v)) for k, v in buckets.items()]


def bits(fmt: str) -> float:
    return UNQUANTIZED_BITS if fmt == KEEP else get_format(fmt).bits


def plan_of(groups: Sequence[Group], choice: dict[str, str]) -> Plan:
    return {m: choice[g.name] for g in groups for m in g.modules if choice[g.name] != KEEP}


def avg_bits(groups: Sequence[Group], choice: dict[str, str]) -> float:
    total = sum(g.params for g in groups)
    return sum(g.params * bits(choice[g.name]) for g in groups) / total


def sensitivities(groups: Sequence[Group], formats: Sequence[str], measure: Measure) -> dict[tuple[str, str], float]:
    return {(g.name, f): measure({m: f for m in g.modules}) for g in groups for f in formats}


def additive_plan(groups: Sequence[Group], sens: dict[tuple[str, str], float], formats: Sequence[str],
                  budget_bits: float) -> dict[str, str] | None:  # fmt: skip
    """The choice minimizing the sum of sensitivities with avg bits <= budget (None: infeasible)."""
    total = sum(g.params for g in groups)
    options = [KEEP, *formats]
    # Pareto front of partial choices: (cost in bit-weights, summed KL, choice), dominated ones dropped.
    front: list[tuple[float, float, dict[str, str]]] = [(0.0, 0.0, {})]
    for g in groups:
        grown = [
            (cost + g.params * bits(f), kl + (0.0 if f == KEEP else sens[(g.name, f)]), {**ch, g.name: f})
            for cost, kl, ch in front for f in options
        ]  # fmt: skip
        grown.sort(key=lambda t: (t[0], t[1]))
        front, best = [], float("inf")
        for item in grown:
            if item[1] < best:
                front.append(item)
                best = item[1]
    feasible = [t for t in front if t[0] <= budget_bits * total + 1e-6]
    return min(feasible, key=lambda t: t[1])[2] if feasible else None


@dataclass
class SearchResult:
    additive: dict[str, str]
    final: dict[str, str]
    predicted_kl: float  # sum of parts of the additive plan
    trials: list[dict[str, Any]] = field(default_factory=list)  # every measured whole config


def local_search(groups: Sequence[Group], sens: dict[tuple[str, str], float], formats: Sequence[str],
                 start: dict[str, str], measure: Measure, max_trials: int) -> SearchResult:  # fmt: skip
    """From the additive plan, greedily move groups to the next-fewer-bits format (least sensitive
    first), keeping each move whose measured KL stays <= the additive plan's predicted KL."""
    ladder = sorted([KEEP, *formats], key=bits, reverse=True)

    def parts(choice: dict[str, str]) -> float:
        return sum(0.0 if f == KEEP else sens[(g, f)] for g, f in choice.items())

    def trial(choice: dict[str, str], move: str) -> dict[str, Any]:
        kl = measure(plan_of(groups, choice))
        entry = {"move": move, "avg_bits": avg_bits(groups, choice), "measured_kl": kl, "sum_of_parts": parts(choice),
                 "cancelled": kl < parts(choice), "accepted": None, "choice": dict(choice)}  # fmt: skip
        result.trials.append(entry)
        return entry

    result = SearchResult(dict(start), dict(start), parts(start))
    current = dict(start)
    trial(current, "additive plan")
    moves = []
    for g in groups:
        i = ladder.index(current[g.name])
        if i + 1 < len(ladder):
            now = current[g.name]
            nxt = ladder[i + 1]
            moves.append((sens[(g.name, nxt)] - (0.0 if now == KEEP else sens[(g.name, now)]), g.name, nxt))
    for _, name, nxt in sorted(moves)[:max_trials]:
        entry = trial({**current, name: nxt}, f"{name} -> {nxt}")
        entry["accepted"] = entry["measured_kl"] <= result.predicted_kl
        if entry["accepted"]:
            current = entry["choice"]
    result.final = current
    return result
