"""The KL report on distributions whose answers are known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvmesh.quant import fidelity


def test_kl_top1_and_next_token_probabilities_of_known_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]])
    s = fidelity.compare_logprobs(p.log(), q.log() + 3.0, torch.tensor([1, 0]), chunk=0)  # logits: any offset
    kl0 = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert s.kl.tolist() == pytest.approx([kl0, 0.0], abs=1e-6)
    assert s.same_top1.tolist() == [False, True]
    assert s.p_ref.tolist() == pytest.approx([0.25, 0.9]) and s.p_test.tolist() == pytest.approx([0.5, 0.9])


def test_report_fields_and_intervals():
    rng = np.random.default_rng(0)
    n = 400
    p_ref = rng.uniform(0.1, 0.9, n)
    s = fidelity.TokenStats(
        kl=rng.exponential(0.01, n),
        same_top1=np.arange(n) % 10 != 0,
        p_ref=p_ref,
        p_test=p_ref * 0.5,
        chunk=np.arange(n) // 20,
    )
    r = fidelity.report(s)
    assert r["tokens"] == n and r["chunks"] == 20
    assert r["same_top1"] == 0.9 and r["same_top1_ci95"][0] < 0.9 < r["same_top1_ci95"][1]
    assert r["ppl_ratio"] == pytest.approx(2.0)  # every next token half as likely: perplexity doubles
    assert r["rms_dp"] == pytest.approx(float(np.sqrt(np.mean((0.5 * p_ref) ** 2))))
    assert r["kl_mean_ci95"][0] <= r["kl_mean"] <= r["kl_mean_ci95"][1]
    assert r["kl_max"] == pytest.approx(s.kl.max()) and r["kl_p99"] <= r["kl_max"]


def test_wilson_interval_matches_the_formula():
    lo, hi = fidelity.wilson(90, 100)
    assert lo == pytest.approx(0.8256, abs=1e-4) and hi == pytest.approx(0.9448, abs=1e-4)
    assert fidelity.wilson(0, 0) == (0.0, 1.0)


def test_a_source_against_its_own_cache_has_zero_kl(tmp_path):
    torch.manual_seed(0)
    table = torch.randn(32, 32)

    def source(ids: torch.Tensor) -> torch.Tensor:
        return table[ids] * 3

    chunks = [torch.randint(0, 32, (n,)) for n in (9, 17, 5)]
    ref = fidelity.ReferenceCache(tmp_path / "ref.f32", chunks, vocab=32)
    ref.build(source)
    same = fidelity.evaluate(ref, source)
    assert len(same.kl) == 8 + 16 + 4 and same.kl.max() < 1e-5 and same.same_top1.all()
    other = fidelity.evaluate(ref, lambda ids: source(ids) + torch.randn(len(ids), 32), chunks=[1])
    assert len(other.kl) == 16 and other.kl.mean() > 0.01


def test_spread_picks_chunks_across_the_set():
    assert fidelity.spread(10, 3) == [0, 4, 9] or fidelity.spread(10, 3) == [0, 5, 9]
    assert fidelity.spread(4, None) == [0, 1, 2, 3] and fidelity.spread(4, 10) == [0, 1, 2, 3]
