"""The draft-cost table a CPU engine measures for itself at start-up."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter
from kvmesh.speculation.verify_cost import costs_from_seconds

from .conftest import PROMPTS
from .test_speculative import ScriptedProposer


def test_costs_count_the_drafting_and_never_fall_below_one_or_with_more_drafts():
    decode = 0.020
    assert costs_from_seconds(decode, [0.024, 0.025], [0.0, 0.0]) == (1.2, 1.25)
    assert costs_from_seconds(decode, [0.024, 0.025], [0.002, 0.004]) == (1.3, 1.45)
    # A verify timed faster than a decode, or than a shorter verify, is noise.
    assert costs_from_seconds(decode, [0.018, 0.030, 0.028], [0.0] * 3) == (1.0, 1.5, 1.5)


class PricedProposer(ScriptedProposer):
    """Garbage drafts that say drafting k of them takes k seconds."""

    def __init__(self) -> None:
        super().__init__(garbage=True)
        self.asked: list[int] = []

    def draft_seconds(self, k: int) -> float:
        self.asked.append(k)
        return float(k)


def test_a_cpu_engine_measures_its_verifies_and_prices_the_proposers_drafting(checkpoints):
    path = checkpoints["llama-gqa"]
    free = LLMEngine(path, EngineConfig(num_blocks=64), drafter=Drafter(ScriptedProposer(), 3))
    assert set(free.drafter.costs) == {1, 8}  # 8 sequences of 4 blocks fit in 64
    for costs in free.drafter.costs.values():
        assert len(costs) == 3 and 1.0 <= costs[0] <= costs[1] <= costs[2]
    # A pool too small for 8 probe sequences is measured alone.
    small = LLMEngine(path, EngineConfig(num_blocks=16), drafter=Drafter(ScriptedProposer(), 3))
    assert set(small.drafter.costs) == {1}

    priced = PricedProposer()
    engine = LLMEngine(path, EngineConfig(num_blocks=64), drafter=Drafter(priced, 3))
    assert priced.asked == [1, 2, 3]
    # Seconds of drafting against a tiny model's millisecond decode: each draft costs many decodes.
    costs = engine.drafter.costs[1]
    assert costs[0] > 50 and costs[2] > 2 * costs[0]
    # The probe wrote pool blocks before any request held one: output is the plain engine's.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLMEngine(path, EngineConfig(num_blocks=64)).generate(PROMPTS, params)
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == [c.token_ids for c in plain]
    # So priced, a sequence asks for one draft a step.
    assert engine.stats.draft_tokens_proposed <= engine.stats.steps * len(PROMPTS)


@pytest.mark.parametrize("costs", [(), (1.5, 2.0)])
def test_configured_costs_are_taken_as_given_and_nothing_is_timed(checkpoints, costs):
    priced = PricedProposer()
    engine = LLMEngine(
        checkpoints["llama-gqa"],
        EngineConfig(num_blocks=64),
        drafter=Drafter(priced, 2, costs),
    )
    assert engine.drafter.costs == {1: costs} and priced.asked == []


def test_a_gpu_pool_is_not_probed(checkpoints):
    """Verify rows are nearly free on a GPU at small batch: no table is measured there (one is on CPU)."""
    priced = PricedProposer()
    drafter = Drafter(priced, 2)
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64), drafter=drafter)
    assert engine.drafter.costs != {1: ()}  # measured on this CPU
    drafter = Drafter(priced, 2)
    drafter.calibrate(engine.model, torch.empty(0, device="meta"), engine.max_model_len)
    assert drafter.costs == {1: ()}
