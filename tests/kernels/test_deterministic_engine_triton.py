"""Deterministic serving on the Triton path (the one a GPU takes), run in the interpreter: an engine
whose ops resolve to the Triton kernels gives a request the same token ids and logprobs, bit for bit,
alone and inside a batch of mixed-length requests with its prompt chunked. Small on purpose: every
kernel call is interpreted."""

from __future__ import annotations

import pytest

import kernels.triton
from kernels.invariant_linear import InvariantLinear
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams
from tests.engine.conftest import write_checkpoint

TARGET = [(7 * i + 3) % 200 + 1 for i in range(21)]
OTHERS = [[(11 * i + j) % 200 + 1 for i in range(3 + 7 * j)] for j in range(5)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


def _bits(engine: LLMEngine, others: list[list[int]]) -> tuple:
    for p in others:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    rid = engine.add_request(TARGET, PARAMS)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += [(lp.logprob.hex(), [(t, v.hex()) for t, v in lp.top]) for lp in out.new_logprobs]
    return tokens, logprobs


@pytest.mark.native_cpu
def test_a_request_gives_the_same_bits_alone_and_batched_with_chunks(tmp_path) -> None:
    path = write_checkpoint(tmp_path / "llama", "llama-gqa", num_hidden_layers=1)

    def engine(**cfg) -> LLMEngine:
        return LLMEngine(path, EngineConfig(num_blocks=64, dtype="float32", deterministic=True, **cfg))

    alone_engine = engine()
    model = alone_engine.runner.model
    assert model.ops.invariant_mm is kernels.triton.KERNELS["invariant_mm"]
    assert model.ops.paged_extend_attention is kernels.triton.INVARIANT_KERNELS["paged_extend_attention"]
    assert isinstance(model.head_proj, InvariantLinear) and model.head_proj.mm is model.ops.invariant_mm
    alone = _bits(alone_engine, [])
    assert len(alone[0]) == PARAMS.max_tokens
    batched = _bits(engine(max_num_batched_tokens=8), OTHERS)  # the prompt in chunks of 8, beside decodes
    assert batched == alone
