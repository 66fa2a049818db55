"""Bad requests raise InvalidArgument (services map it to INVALID_ARGUMENT / HTTP 400)."""

from __future__ import annotations

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(temperature=0.0, max_tokens=16), "prompt is empty"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=-3), "max_tokens"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=16, top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=16, top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(max_tokens=16, temperature=-1), "temperature"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=16, min_p=1.0), "min_p"),
        ([1] * 512, SamplingParams(temperature=0.0, max_tokens=16), "context"),
        ([1, 10_000], SamplingParams(temperature=0.0, max_tokens=16), "vocabulary"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=16, stop=["x"]), "tokenizer"),
    ],
)
def test_bad_input_raises_invalid_argument(engine, prompt, params, message):
    with pytest.raises(InvalidArgument, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_request_larger_than_the_whole_pool_is_refused(checkpoints):
    small = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=4))
    with pytest.raises(InvalidArgument, match="pool"):
        small.add_request([1] * 60, SamplingParams(temperature=0.0, max_tokens=10))


def test_abort_unknown_request_is_not_found(engine):
    with pytest.raises(NotFound):
        engine.abort("nope")
