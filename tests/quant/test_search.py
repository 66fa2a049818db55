"""The planner and the local search on synthetic sensitivities and synthetic measurements."""

from __future__ import annotations

import itertools

from kvmesh.quant import search

FORMATS = ("fp8-channel", "nvfp4")
GROUPS = [search.Group(f"g{i}", (f"model.layers.{i}.mlp.up_proj",), p) for i, p in enumerate((100, 200, 300, 400))]
SENS = {
    ("g0", "fp8-channel"): 0.01, ("g0", "nvfp4"): 0.50, ("g1", "fp8-channel"): 0.002, ("g1", "nvfp4"): 0.03,
    ("g2", "fp8-channel"): 0.004, ("g2", "nvfp4"): 0.02, ("g3", "fp8-channel"): 0.001, ("g3", "nvfp4"): 0.2,
}  # fmt: skip


def _brute_force(budget: float) -> tuple[float, dict]:
    best = (float("inf"), {})
    for combo in itertools.product([search.KEEP, *FORMATS], repeat=len(GROUPS)):
        choice = {g.name: f for g, f in zip(GROUPS, combo)}
        if search.avg_bits(GROUPS, choice) <= budget + 1e-9:
            kl = sum(0.0 if f == search.KEEP else SENS[(g, f)] for g, f in choice.items())
            best = min(best, (kl, choice), key=lambda t: t[0])
    return best


def test_the_additive_plan_is_the_exact_optimum_under_each_budget():
    for budget in (4.5, 5.0, 6.0, 7.0, 8.0, 12.0, 16.0):
        plan = search.additive_plan(GROUPS, SENS, FORMATS, budget)
        kl, _ = _brute_force(budget)
        assert search.avg_bits(GROUPS, plan) <= budget + 1e-9
        assert sum(0.0 if f == search.KEEP else SENS[(g, f)] for g, f in plan.items()) == kl
    assert search.additive_plan(GROUPS, SENS, FORMATS, 4.0) is None


def test_layer_groups_split_attention_and_mlp_by_blocks_of_layers():
    modules = [f"model.layers.{i}.{k}" for i in range(4) for k in ("self_attn.q_proj", "mlp.down_proj")]
    groups = search.layer_groups(modules, lambda m: 10, 2)
    assert [(g.name, len(g.modules), g.params) for g in groups] == [
        ("L0-1.attn", 2, 20),
        ("L0-1.mlp", 2, 20),
        ("L2-3.attn", 2, 20),
        ("L2-3.mlp", 2, 20),
    ]


def _measure_with(interaction: float):
    """A whole-config KL: the sum of parts times ``interaction`` (< 1: errors cancel)."""

    def measure(plan: dict) -> float:
        layer = {m: g.name for g in GROUPS for m in g.modules}
        return interaction * sum(SENS[(layer[m], f)] for m, f in plan.items())

    return measure


def test_local_search_quantizes_more_when_errors_cancel_and_records_it():
    start = search.additive_plan(GROUPS, SENS, FORMATS, 8.0)
    res = search.local_search(GROUPS, SENS, FORMATS, start, _measure_with(0.5), max_trials=8)
    assert search.avg_bits(GROUPS, res.final) < search.avg_bits(GROUPS, start)
    assert all(t["cancelled"] for t in res.trials)
    assert all(t["measured_kl"] <= res.predicted_kl for t in res.trials if t["accepted"])


def test_local_search_keeps_the_additive_plan_when_errors_compound():
    start = search.additive_plan(GROUPS, SENS, FORMATS, 8.0)
    res = search.local_search(GROUPS, SENS, FORMATS, start, _measure_with(1.5), max_trials=8)
    assert res.final == start and not any(t["cancelled"] for t in res.trials)
    assert res.trials[0]["move"] == "additive plan" and len(res.trials) > 1
