"""Sampling parameters, stop conditions and the repetition guard."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampler import filter_probs
from kvmesh.sampling import SamplingParams

from .conftest import resolved

PROMPT = [17, 50, 60, 61, 62]


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=128))


def _run(engine, params, prompts=(PROMPT,)):
    return engine.generate([list(p) for p in prompts], params)


def test_same_seed_same_output_even_in_different_batches(engine):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _run(engine, p)[0].token_ids
    batched = _run(engine, [p, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)], [PROMPT, [9, 9, 9]])
    assert batched[0].token_ids == alone
    other_seed = _run(engine, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = _run(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].token_ids
    top_k = _run(engine, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=3, ignore_eos=True))[0]
    top_p = _run(engine, SamplingParams(max_tokens=16, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert top_k.token_ids == greedy
    assert top_p.token_ids == greedy


def test_filter_probs_top_p_min_p_top_k():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = filter_probs(logits, resolved(max_tokens=16, temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = filter_probs(logits, resolved(max_tokens=16, temperature=1.0, min_p=0.5))  # keep p >= 0.25
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = filter_probs(logits, resolved(max_tokens=16, temperature=1.0, top_k=3))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    probs = filter_probs(logits, resolved(max_tokens=16, temperature=1.0))
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(probs, 20000, replacement=True, generator=g)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.015)


def test_stop_token_ids_and_max_tokens(engine):
    free = _run(engine, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = _run(engine, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_top_logprobs_are_sorted_and_include_the_greedy_choice(engine):
    res = _run(engine, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    for tok, lp in zip(res.token_ids, res.logprobs):
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)


def test_repetition_guard_finishes_a_collapsed_sequence(checkpoints):
    # A model whose output collapses to one token: make every logit favour token 7.
    engine = LLMEngine(checkpoints["llama-mha-tied"], EngineConfig(num_blocks=64))
    with torch.no_grad():
        engine.model.embed_tokens.weight[7] *= 50  # tied head: token 7 dominates
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    collapsed = _run(engine, base, [[7, 7, 7]])[0]
    assert collapsed.token_ids[-5:] == [7] * 5
    guarded = _run(
        engine, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_limit=4), [[7, 7, 7]]
    )[0]
    assert guarded.finish_reason == "repetition"
    assert guarded.token_ids == [7] * 5
    allowed = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_limit=4, repetition_allow=[7])
    assert _run(engine, allowed, [[7, 7, 7]])[0].finish_reason == "length"


def test_a_denormal_temperature_samples_greedily_rather_than_overflowing(engine):
    """Logits divided by 1.4e-45 are inf and the probabilities NaN; such a temperature means argmax."""
    greedy = _run(engine, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    for t in (1.4e-45, 3.4e-41, 1e-6):
        assert _run(engine, SamplingParams(temperature=t, max_tokens=8, ignore_eos=True))[0].token_ids == greedy
