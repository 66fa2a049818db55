"""Speculation with the shipped draft model: greedy output identical to no speculation,
drafts accepted, nothing leaked in either engine."""

from __future__ import annotations

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.draft_model import DraftModelProposer, DraftRequest
from kvmesh.speculation.drafter import Drafter

from .conftest import CODE_PROMPTS, DRAFT, SMALL


def test_draft_model_speculation_keeps_greedy_output_and_accepts_drafts():
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLMEngine(SMALL, EngineConfig(num_blocks=128))
    prompts = [plain.tokenizer.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    expected = [c.token_ids for c in plain.generate(prompts, params)]

    proposer = DraftModelProposer(DRAFT, EngineConfig(num_blocks=128))
    spec = LLMEngine(SMALL, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 4, ()))
    got = [c.token_ids for c in spec.generate(prompts, params)]

    assert got == expected
    assert spec.stats.draft_tokens_accepted > 0
    assert spec.stats.steps < plain.stats.steps
    assert spec.blocks.num_free == 128
    draft_engine = proposer.engine
    assert not draft_engine.has_unfinished() and draft_engine.blocks.num_free == 128
    # Later calls re-used the draft KV of earlier ones instead of recomputing whole contexts.
    assert draft_engine.stats.cached_prompt_tokens > draft_engine.stats.computed_tokens


def test_draft_lengths_respect_the_draft_models_context():
    proposer = DraftModelProposer(DRAFT, EngineConfig(num_blocks=128))
    limit = proposer.engine.max_model_len
    drafts = proposer.draft(
        [
            DraftRequest("near-limit", [11] * (limit - 2), 4),
            DraftRequest("at-limit", [11] * limit, 4),
            DraftRequest("empty", [], 4),
            DraftRequest("short", [11, 12, 13], 3),
        ]
    )
    assert {rid: len(d) for rid, d in drafts.items()} == {"near-limit": 2, "short": 3}
    assert proposer.engine.blocks.num_free == 128


def test_a_context_the_draft_model_cannot_take_fails_clearly_and_leaks_nothing():
    proposer = DraftModelProposer(DRAFT, EngineConfig(num_blocks=128))
    vocab = proposer.engine.model_config.vocab_size
    with pytest.raises(InvalidArgument, match="vocabulary"):
        proposer.draft([DraftRequest("fine", [11, 12, 13], 4), DraftRequest("bad", [11, vocab + 5], 4)])
    assert not proposer.engine.has_unfinished()
    assert proposer.engine.blocks.num_free == 128
    # The proposer still works afterwards.
    assert len(proposer.draft([DraftRequest("fine", [11, 12, 13], 4)])["fine"]) == 4
