"""Draft length per sequence: as many drafts as pay for themselves, never fewer than one."""

from __future__ import annotations

import pytest

from kvmesh.engine import EngineConfig, LLMEngine, SamplingParams
from kvmesh.engine.draft_length import DraftLengthPolicy, best_length, tokens_per_step

from .conftest import PROMPTS
from .test_speculative import ScriptedProposer


def test_tokens_per_step_of_a_chain():
    assert tokens_per_step(0.0, 4) == 1.0  # only the bonus token
    assert tokens_per_step(1.0, 4) == 5.0
    assert tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_the_length_grows_with_acceptance_and_shrinks_with_cost():
    assert best_length(0.9, 4, cost=0.15) == 4
    assert best_length(0.2, 4, cost=0.15) == 1
    lengths = [best_length(a, 8, cost=0.15) for a in (0.3, 0.5, 0.7, 0.9)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert best_length(0.3, 4, cost=0.0) == 4  # free drafts: always the most


def test_a_sequence_starts_from_the_engine_wide_rate_and_moves_with_its_own():
    policy = DraftLengthPolicy(max_k=4, cost=0.15)
    for _ in range(50):
        policy.record(4, 4)  # traffic whose drafts all land
    assert policy.choose(accepted=0, missed=0, room=100) == 4
    assert policy.choose(accepted=0, missed=30, room=100) == 1  # this one's never do
    assert policy.choose(accepted=40, missed=0, room=2) == 2  # no more than room
    assert DraftLengthPolicy(max_k=4, cost=0.0).choose(0, 30, room=100) == 4


def test_an_engine_drafts_less_for_drafts_that_miss_and_output_stays_identical(checkpoints):
    path = checkpoints["llama-gqa"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [c.token_ids for c in LLMEngine(path, EngineConfig(num_blocks=128)).generate(PROMPTS, params)]
    proposed = {}
    for cost in (0.0, 0.15):
        spec = LLMEngine(path, EngineConfig(num_blocks=128, num_speculative_tokens=4, draft_cost=cost),
                         proposer=ScriptedProposer(garbage=True))
        assert [c.token_ids for c in spec.generate(PROMPTS, params)] == plain
        proposed[cost] = spec.stats.draft_tokens_proposed
    # Garbage is never accepted: with a cost, each sequence soon asks for one draft a step.
    assert proposed[0.15] < proposed[0.0] / 2
