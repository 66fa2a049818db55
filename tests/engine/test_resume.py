"""A migrated request resumed from the tokens already delivered: the same continuation, text and grammar state."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.structured.spec import GrammarSpec


@pytest.fixture(scope="module")
def engine(llama_with_tokenizer) -> LLMEngine:
    return LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=256))


def _stream(engine: LLMEngine, prompt: list[int], params: SamplingParams, **options) -> tuple[list[int], str, str]:
    rid = engine.add_request(prompt, params, **options)
    tokens, text, reason = [], "", ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            text += out.text_delta
            reason = out.finish_reason or reason
    return tokens, text, reason


def _delivered_text(engine: LLMEngine, prompt: list[int], params: SamplingParams, cut: int) -> str:
    """What a client had received when the first worker died right after token ``cut``."""
    rid = engine.add_request(prompt, params)
    text, n = "", 0
    while n < cut:
        for out in engine.step():
            text += out.text_delta
            n += len(out.new_token_ids)
    engine.abort(rid)
    return text


@pytest.mark.parametrize("cut", [1, 7, 19])
def test_greedy_resume_continues_with_exactly_the_unbroken_tokens_and_text(engine, cut) -> None:
    prompt = engine.tokenizer.encode("def main():\n")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    full, text, reason = _stream(engine, prompt, params)
    before = _delivered_text(engine, prompt, params, cut)

    rest, rest_text, rest_reason = _stream(engine, prompt, params, resume_ids=full[:cut])

    assert full[:cut] + rest == full and len(rest) == 32 - cut  # max_tokens counts the resumed tokens
    assert before + rest_text == text
    assert rest_reason == reason == "length"


def test_penalties_count_the_resumed_tokens_as_output(engine) -> None:
    prompt = engine.tokenizer.encode("def main():\n")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=32,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
    )
    full, _, _ = _stream(engine, prompt, params)

    rest, _, _ = _stream(engine, prompt, params, resume_ids=full[:11])

    assert full[:11] + rest == full


def test_a_stop_string_held_back_at_the_cut_is_released_or_cut_as_unbroken(engine) -> None:
    prompt = engine.tokenizer.encode("class A:\n")
    free, free_text, _ = _stream(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    # A stop string whose first characters end the text of token 4: the first worker held them back.
    head = engine.tokenizer.decode(free[:4])
    stop = free_text[len(head) - 1 : len(head) + 3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    _, text, reason = _stream(engine, prompt, params)
    before = _delivered_text(engine, prompt, params, 4)
    assert len(before) < len(head)  # the first worker held the stop string's beginning back

    _, rest_text, rest_reason = _stream(engine, prompt, params, resume_ids=free[:4])
    assert before + rest_text == text
    assert rest_reason == reason == "stop"


def test_a_resumed_structured_output_starts_with_its_grammar_advanced(engine) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    prompt = engine.tokenizer.encode("Answer in JSON: ")
    params = SamplingParams(temperature=0.0, max_tokens=120, grammar=GrammarSpec.json_schema(schema))
    full, text, reason = _stream(engine, prompt, params)
    assert reason == "stop"
    cut = len(full) // 2

    rest, rest_text, rest_reason = _stream(engine, prompt, params, resume_ids=full[:cut])

    assert full[:cut] + rest == full and rest_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(full[:cut] + rest)), schema)
    with pytest.raises(InvalidArgument, match="not allowed by the request's grammar"):
        engine.add_request(prompt, params, resume_ids=engine.tokenizer.encode("zz"))  # JSON starts with {


@pytest.mark.parametrize("cut", [1, 5, 17])
def test_a_seeded_resume_samples_what_the_unbroken_stream_did(engine, cut) -> None:
    # Output position i draws from (seed, i) alone, so the worker that resumes draws what the first would have.
    prompt = engine.tokenizer.encode("x = ")
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    full, text, _ = _stream(engine, prompt, params)
    before = _delivered_text(engine, prompt, params, cut)

    rest, rest_text, _ = _stream(engine, prompt, params, resume_ids=full[:cut])

    assert full[:cut] + rest == full and before + rest_text == text
    other_seed, _, _ = _stream(engine, prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=8, ignore_eos=True))
    assert other_seed != full  # the seed matters (24 draws at temperature 1 from a random model)


def test_a_seeded_request_handed_off_after_its_first_token_samples_the_same_text(engine) -> None:
    prompt = engine.tokenizer.encode("y = ")
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    full, _, _ = _stream(engine, prompt, params)

    # As a decode worker continues a prefill: the first token is streamed as its first output.
    decoded, _, _ = _stream(engine, prompt, params, first_token=full[0])

    assert decoded == full


def test_resume_refuses_what_leaves_no_room(engine) -> None:
    prompt = engine.tokenizer.encode("x = ")
    with pytest.raises(InvalidArgument, match="leave no room"):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3), resume_ids=[5, 6, 7])
    with pytest.raises(InvalidArgument, match="cannot also carry a first token"):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8), resume_ids=[5], first_token=6)
