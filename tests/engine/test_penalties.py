"""logit_bias and the presence/frequency/repetition penalties against transformers' logits processors.

Row-level: ``adjust_row`` equals transformers' RepetitionPenaltyLogitsProcessor and
SequenceBiasLogitsProcessor, and OpenAI's presence/frequency formula, on random logits.
Engine-level: greedy generation with a penalty is token-identical to transformers'
``generate`` with the same processor, in a continuous batch and with speculation.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.penalties import PenaltyState, adjust_row
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .conftest import resolved
from .test_speculative import ScriptedProposer

V = 512
PROMPTS = [[17, 50, 60, 61, 62, 50, 50], [5, 6, 7, 8], [300, 301, 17, 17, 17, 9]]


def _state(prompt: list[int], output: list[int], params: SamplingParams) -> PenaltyState:
    state = PenaltyState.new(prompt, params, V, torch.device("cpu"))
    state.catch_up(output)
    return state


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    prompt, output = [3, 9, 9, 40, 100], [40, 7, 7, 7, 250]
    logits = torch.randn(V, generator=g) * 4
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone()[None])[0]
    got = logits.clone()
    params = resolved(temperature=0.0, max_tokens=16, repetition_penalty=penalty)
    adjust_row(got, params, _state(prompt, output, params), [])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_logit_bias_matches_transformers_sequence_bias():
    from transformers import SequenceBiasLogitsProcessor

    bias = {5: 100.0, 17: -100.0, 300: 2.5}
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    proc = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = proc(torch.tensor([[1, 2, 3]]), logits.clone()[None])[0]
    got = logits.clone()
    params = resolved(temperature=0.0, max_tokens=16, logit_bias=bias)
    adjust_row(got, params, _state([1, 2, 3], [], params), [])
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_are_openais_formula_over_generated_tokens():
    prompt, output = [7, 7, 8], [8, 9, 9, 9, 11]
    logits = torch.randn(V, generator=torch.Generator().manual_seed(2))
    expected = logits.clone()
    for tok in set(output):  # prompt tokens are not penalized (OpenAI counts the completion)
        expected[tok] -= output.count(tok) * 0.5 + 1.25
    got = logits.clone()
    params = resolved(temperature=0.0, max_tokens=16, presence_penalty=1.25, frequency_penalty=0.5)
    adjust_row(got, params, _state(prompt, output, params), [])
    torch.testing.assert_close(got, expected)


def test_a_draft_row_counts_the_drafts_before_it():
    prompt, output, drafts = [1, 2], [3, 4], [4, 5]
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    params = resolved(temperature=0.0, max_tokens=16, frequency_penalty=1.0, repetition_penalty=1.5)
    got = logits.clone()
    adjust_row(got, params, _state(prompt, output, params), drafts)
    expected = logits.clone()
    adjust_row(expected, params, _state(prompt, output + drafts, params), [])
    torch.testing.assert_close(got, expected)


def _hf_greedy(path, prompt, n, **processors):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **processors)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()


def test_greedy_with_repetition_penalty_and_bias_identical_to_transformers(checkpoints):
    path = checkpoints["llama-gqa"]
    bias = {33: 5.0, 60: -100.0}
    expected = [
        _hf_greedy(path, p, 24, repetition_penalty=1.4, sequence_bias={(t,): b for t, b in bias.items()})
        for p in PROMPTS
    ]
    params = resolved(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4, logit_bias=bias)
    engine = LLMEngine(path, EngineConfig(num_blocks=128))
    plain = engine.generate(PROMPTS, resolved(temperature=0.0, max_tokens=24, ignore_eos=True))
    got = engine.generate(PROMPTS, params)
    assert [c.token_ids for c in got] == expected
    assert [c.token_ids for c in plain] != expected  # the penalty changed something
    assert all(60 not in c.token_ids for c in got)

    # Speculation with oracle and garbage drafts: the same tokens.
    for proposer in (ScriptedProposer({f"req-{i}": t for i, t in enumerate(expected)}), ScriptedProposer(garbage=True)):
        spec = LLMEngine(path, EngineConfig(num_blocks=128), drafter=Drafter(proposer, 3, ()))
        assert [c.token_ids for c in spec.generate(PROMPTS, params)] == expected
        assert spec.stats.draft_tokens_proposed > 0


def test_frequency_penalty_breaks_a_collapse(checkpoints):
    engine = LLMEngine(checkpoints["llama-mha-tied"], EngineConfig(num_blocks=64))
    with torch.no_grad():
        engine.model.embed_tokens.weight[7] *= 8  # tied head: token 7 dominates
    collapsed = engine.generate([[7, 7, 7]], resolved(temperature=0.0, max_tokens=40, ignore_eos=True))[0].token_ids
    penalized = engine.generate(
        [[7, 7, 7]],
        resolved(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
    )[0].token_ids
    assert collapsed == [7] * 40 and penalized.count(7) < 20


@pytest.mark.parametrize(
    "params, message",
    [
        (resolved(temperature=0.0, max_tokens=16, presence_penalty=2.5), "presence_penalty must be a finite number in"),
        (
            resolved(temperature=0.0, max_tokens=16, frequency_penalty=-3),
            "frequency_penalty must be a finite number in",
        ),
        (
            resolved(temperature=0.0, max_tokens=16, repetition_penalty=0),
            "repetition_penalty must be a finite number in",
        ),
        (resolved(temperature=0.0, max_tokens=16, logit_bias={V: 1.0}), "logit_bias: token id 512 is outside"),
        (
            resolved(temperature=0.0, max_tokens=16, logit_bias={3: 101.0}),
            r"logit_bias\[3\] must be a finite number in",
        ),
    ],
)
def test_bad_values_are_refused(params, message):
    with pytest.raises(InvalidArgument, match=message):
        params.validate(V)
