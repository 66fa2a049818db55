"""Deterministic serving in one engine (``EngineConfig(deterministic=True)``): a request's token ids
and logprobs are the same bits alone, inside a batch of 16 mixed-length requests, after its prefix
was cached, with its prompt chunked differently, under speculation and resumed after a migration;
for a seeded sampled request as for a greedy one; and across two tensor-parallel ranks. Without the
flag a batch does move them (shown at one rank; at two, the same comparison fails too), so these
tests can fail. The mesh cases (split prefill/decode, NIXL, a killed worker) are in
tests/e2e/test_determinism.py."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sequence import TokenLogprob
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter

from .conftest import write_checkpoint
from .test_speculative import ScriptedProposer

NEW_TOKENS = 24
# Wide enough that the GEMMs take different paths by row count (a 64-wide toy model's do not).
WIDE = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
TARGET = [(7 * i + 3) % 500 + 1 for i in range(45)]
OTHERS = [[(11 * i + j) % 500 + 1 for i in range(5 + 9 * j)] for j in range(15)]  # 5 to 131 tokens

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
    "seeded": SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("wide") / "llama", "llama-gqa", **WIDE)


Run = tuple[list[int], list[TokenLogprob]]


def _engine(path, dtype: str, deterministic: bool = True, drafter=None, **cfg) -> LLMEngine:
    return LLMEngine(
        path, EngineConfig(**{"num_blocks": 256, **cfg}, dtype=dtype, deterministic=deterministic), drafter=drafter
    )


def _run(engine: LLMEngine, params: SamplingParams, others: list[list[int]] = (), **options) -> Run:
    """The target request's (token ids, logprobs), submitted after ``others`` (half of them) and before the rest."""
    half = len(others) // 2
    for p in others[:half]:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS + 8, ignore_eos=True))
    rid = engine.add_request(TARGET, params, **options)
    for p in others[half:]:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - 5, ignore_eos=True))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += out.new_logprobs
    return tokens, logprobs


def _bits(run: Run) -> tuple:
    """Token ids and every logprob as exact float bits (== on floats would still be exact; this says so)."""
    tokens, logprobs = run
    return tokens, [(lp.token_id, lp.logprob.hex(), [(t, v.hex()) for t, v in lp.top]) for lp in logprobs]


@pytest.mark.native_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_request_gives_the_same_bits_whatever_its_batch_cache_chunks_or_migration(wide_llama, dtype, kind):
    params = PARAMS[kind]
    engine = _engine(wide_llama, dtype)
    alone = _run(engine, params)
    assert len(alone[0]) == NEW_TOKENS and len(alone[1]) == NEW_TOKENS

    cases = {"again, its prefix cached": _run(engine, params)}
    # Chunks of 16 tokens: the prompt in three steps, each shared with the other requests' decodes.
    cases["in a batch of 16, prompt in chunks of 16"] = _run(
        _engine(wide_llama, dtype, max_num_batched_tokens=16), params, OTHERS
    )
    cases["in a batch of 16, whole prompts"] = _run(_engine(wide_llama, dtype), params, OTHERS)
    cut = 10
    resumed = _run(engine, params, resume_ids=alone[0][:cut])
    cases["resumed after its 10th token"] = (alone[0][:cut] + resumed[0], alone[1][:cut] + resumed[1])
    # Sampled too: under --deterministic a verify row keeps the token plain decoding draws at its position.
    speculating = _engine(wide_llama, dtype, drafter=Drafter(ScriptedProposer(garbage=True), 3, ()))
    cases["speculating, drafts rejected"] = _run(speculating, params, OTHERS[:5])
    # Drafts that are the answer: every token but the bonus one comes out of a verify row.
    oracle = _engine(wide_llama, dtype, drafter=Drafter(ScriptedProposer({"target": alone[0]}), 3, ()))
    cases["speculating, drafts accepted"] = _run(oracle, params, OTHERS[:5], request_id="target")
    assert oracle.stats.draft_tokens_accepted >= NEW_TOKENS // 2  # most tokens did come from verify rows
    for name, run in cases.items():
        assert _bits(run) == _bits(alone), f"{dtype} {kind}: {name} differs from the request alone"


@pytest.mark.native_cpu
def test_without_the_flag_a_batch_moves_the_logprobs(wide_llama):
    """The same comparison with deterministic off: the library GEMMs round a row by its batch."""
    params = PARAMS["greedy"]
    alone = _run(_engine(wide_llama, "bfloat16", deterministic=False), params)
    batched = _run(_engine(wide_llama, "bfloat16", deterministic=False), params, OTHERS)
    assert _bits(batched) != _bits(alone)


@pytest.mark.native_cpu
def test_deterministic_refuses_what_it_cannot_keep(wide_llama):
    from kvmesh.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="quantized"):
        _engine(wide_llama, "float32", quantization="int8")
    engine = _engine(wide_llama, "float32", compile=True)  # compile is ignored: the step runs eager
    assert engine.runner.model.compiled_decode is None
    assert torch.equal(engine.runner.model.head_weight, engine.runner.model.head_proj.weight)


@pytest.mark.native_cpu
def test_system_fingerprint_names_what_decides_the_bits(wide_llama):
    fingerprint = _engine(wide_llama, "float32").system_fingerprint
    assert fingerprint.startswith("fp_")
    # Scheduling knobs do not change a request's bits under --deterministic, so they do not change the name.
    assert _engine(wide_llama, "float32", max_num_batched_tokens=16, num_blocks=64).system_fingerprint == fingerprint
    assert _engine(wide_llama, "float32", deterministic=False).system_fingerprint != fingerprint
    assert _engine(wide_llama, "bfloat16").system_fingerprint != fingerprint


@pytest.mark.native_cpu
@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_across_two_ranks_a_request_gives_the_same_bits_whatever_its_batch_cache_or_chunks(wide_llama, kind):
    """The same promise at tensor-parallel degree 2 (each rank's products invariant, the all-reduces summed
    in rank order): bitwise within the degree. Another degree sums otherwise, so its KV is not shared."""
    params, engines = PARAMS[kind], []

    def engine(**cfg) -> LLMEngine:
        engines.append(_engine(wide_llama, "bfloat16", tensor_parallel_size=2, **cfg))
        return engines[-1]

    try:
        first = engine()
        alone = _run(first, params)
        cached = _run(first, params)
        batched = _run(engine(max_num_batched_tokens=16), params, OTHERS)
        assert _bits(cached) == _bits(alone) and _bits(batched) == _bits(alone)
        one_rank = _engine(wide_llama, "bfloat16")
        assert first.runner.fingerprint != one_rank.runner.fingerprint  # no KV shared across degrees
        assert first.system_fingerprint != one_rank.system_fingerprint
    finally:
        for e in engines:
            e.close()
