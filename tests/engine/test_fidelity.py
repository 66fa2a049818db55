"""Greedy output and logprobs match Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams

from .conftest import ARCHS, PROMPTS
from .hf_reference import hf_greedy

N_NEW = 32


def _greedy(max_tokens: int = N_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers(checkpoints, arch):
    path = checkpoints[arch]
    engine = LLMEngine(path, EngineConfig(num_blocks=128))
    # All prompts in one continuous batch: batching must not change greedy output.
    results = engine.generate(PROMPTS, _greedy())
    for prompt, res in zip(PROMPTS, results):
        ref_ids, ref_lps = hf_greedy(path, prompt, N_NEW)
        assert res.token_ids == ref_ids, f"{arch}: prompt {prompt[:4]}..."
        ours = [lp.logprob for lp in res.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4


def test_requests_joining_at_different_steps_keep_greedy_output(checkpoints):
    """Staggered arrivals, small chunks: prefill chunks and decodes mix in one batch."""
    path = checkpoints["llama-gqa"]
    engine = LLMEngine(path, EngineConfig(num_blocks=128, max_num_batched_tokens=24))
    expected = {i: hf_greedy(path, p, N_NEW)[0] for i, p in enumerate(PROMPTS)}
    got: dict[str, list[int]] = {}
    rid_of = {}
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            rid_of[engine.add_request(prompt, _greedy())] = i
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert {rid_of[r]: toks for r, toks in got.items()} == expected
