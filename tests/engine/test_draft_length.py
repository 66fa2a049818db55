"""Draft length per sequence: as many drafts as pay for themselves, never fewer than one."""

from __future__ import annotations

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.draft_length import (
    DraftLengthPolicy,
    best_length,
    parse_draft_costs,
    step_cost,
    tokens_per_step,
)
from kvmesh.speculation.drafter import Drafter

from .conftest import PROMPTS
from .test_speculative import ScriptedProposer

# A float32 table measured on an Intel (AMX) dev machine: verifies of 3+ drafts cost more there.
COSTS = (1.21, 1.27, 1.56, 1.64)


def test_tokens_per_step_of_a_chain():
    assert tokens_per_step(0.0, 4) == 1.0  # only the bonus token
    assert tokens_per_step(1.0, 4) == 5.0
    assert tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_step_cost_reads_the_table_and_extrapolates_past_it():
    assert step_cost((1.2, 1.5), 0) == 1.0
    assert step_cost((1.2, 1.5), 2) == 1.5
    assert step_cost((1.2, 1.5), 4) == pytest.approx(1.5 + 2 * 0.3)
    assert step_cost((1.2,), 3) == pytest.approx(1.6)


def test_the_length_grows_with_acceptance_and_drafts_free_are_always_all_taken():
    assert best_length(0.9, 4, COSTS) == 4
    assert best_length(0.2, 4, COSTS) == 1
    lengths = [best_length(a, 8, COSTS) for a in (0.3, 0.5, 0.7, 0.9)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert best_length(0.3, 4, ()) == 4


def test_a_sequence_starts_from_the_engine_wide_rate_and_moves_with_its_own():
    policy = DraftLengthPolicy(max_k=4, costs={1: COSTS})
    for _ in range(50):
        policy.record(4, 4)  # traffic whose drafts all land
    assert policy.choose(accepted=0, missed=0, room=100) == 4
    assert policy.choose(accepted=0, missed=30, room=100) == 1  # this one's never do
    assert policy.choose(accepted=40, missed=0, room=2) == 2  # no more than room
    assert DraftLengthPolicy(max_k=4, costs={1: ()}).choose(0, 30, room=100) == 4


def test_draft_costs_parse():
    assert parse_draft_costs(None) is None
    assert parse_draft_costs("free") == ()
    assert parse_draft_costs("1.2,1.3") == (1.2, 1.3)
    for bad in ("0.9", "1.5,1.2", "x"):
        with pytest.raises(ValueError):
            parse_draft_costs(bad)


def test_an_engine_drafts_less_for_drafts_that_miss_and_output_stays_identical(checkpoints):
    path = checkpoints["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = [c.token_ids for c in LLMEngine(path, EngineConfig(num_blocks=128)).generate(PROMPTS, params)]
    proposed = {}
    for costs in ((), COSTS):
        spec = LLMEngine(
            path,
            EngineConfig(num_blocks=128),
            drafter=Drafter(ScriptedProposer(garbage=True), 4, costs),
        )
        assert [c.token_ids for c in spec.generate(PROMPTS, params)] == plain
        proposed[costs] = spec.stats.draft_tokens_proposed
    # Garbage is never accepted: priced, each sequence soon asks for one draft a step.
    assert proposed[COSTS] < proposed[()] / 2


def test_a_step_is_priced_by_the_table_of_the_largest_batch_measured_at_or_below_it():
    cheap, dear = (1.0, 1.0, 1.0, 1.0), (2.0, 3.0, 4.0, 5.0)
    policy = DraftLengthPolicy(max_k=4, costs={1: cheap, 8: dear})
    assert policy.costs_at(1) == policy.costs_at(7) == cheap and policy.costs_at(8) == policy.costs_at(64) == dear
    # The same sequence: all four drafts alone, one in a batch of 8 where each costs a decode more.
    assert policy.choose(accepted=10, missed=10, room=100, batch=1) == 4
    assert policy.choose(accepted=10, missed=10, room=100, batch=8) == 1
