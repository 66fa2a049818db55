"""Decode speed of an engine, as the model benchmarks measure it (bench/models.py, moe.py, mla.py)."""

from __future__ import annotations

import time

from kvmesh.sampling import SamplingParams


def tokens_per_s(engine, streams: int, round_no: int) -> float:
    """Tokens a second of ``streams`` requests at once (64-token prompts that differ per round, 64 greedy
    tokens, EOS ignored), after a 2-token request has paid the first step's costs. ``engine``: anything with
    ``LLMEngine.generate``'s signature."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[(37 * i + 11 * s + round_no) % 8000 + 3 for i in range(64)] for s in range(streams)]
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in out) / (time.perf_counter() - t0)
