"""Grammar-constrained decoding in the engine: valid output in a mixed continuous batch,
identical output with speculation, hand-offs, preemption, and clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import InvalidArgument
from kvmesh.sampling import SamplingParams
from kvmesh.speculation.drafter import Drafter
from kvmesh.structured.spec import GrammarSpec
from tests.structured.schemas import SCHEMAS

from .test_speculative import ScriptedProposer

MAX_TOKENS = 200


@pytest.fixture(scope="module")
def engine(llama_with_tokenizer) -> LLMEngine:
    return LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=1024))


def _prompt(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode("Answer in JSON: ")


def _constrained(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, grammar=GrammarSpec.json_schema(schema), **({"temperature": 0.0} | kw))


def test_every_schema_output_validates_in_one_batch_with_free_requests(engine):
    prompt = _prompt(engine)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = engine.generate([prompt], free)[0].token_ids
    params = [_constrained(s) for _, s in SCHEMAS] + [free, free]
    outs = engine.generate([prompt] * len(params), params)
    for (name, schema), out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)  # json.loads is strict: no raw control chars
    # Unconstrained neighbours are untouched by the masks.
    assert outs[-1].token_ids == outs[-2].token_ids == alone
    assert engine.stats.grammar_masked_rows > 0


def test_sampled_constrained_output_also_validates(engine):
    prompt = _prompt(engine)
    picked = [s for _, s in SCHEMAS[:8]]
    params = [_constrained(s, temperature=1.0, seed=i, top_p=0.95) for i, s in enumerate(picked)]
    for schema, out in zip(picked, engine.generate([prompt] * len(picked), params)):
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_ebnf_and_any_json(engine):
    prompt = _prompt(engine)
    specs = [
        GrammarSpec("regex", r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"),
        GrammarSpec("ebnf", 'root ::= "(" item (", " item){0,3} ")"\nitem ::= [a-z] [0-9]?'),
        GrammarSpec("any_json"),
    ]
    outs = engine.generate(
        [prompt] * 3, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=g) for g in specs]
    )
    assert re.fullmatch(r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}", outs[0].text)
    assert re.fullmatch(r"\([a-z][0-9]?(, [a-z][0-9]?){0,3}\)", outs[1].text)
    json.loads(outs[2].text)
    assert all(o.finish_reason == "stop" for o in outs[:2])


def test_the_grammar_end_finishes_the_request_even_with_ignore_eos(engine):
    out = engine.generate(
        [_prompt(engine)],
        SamplingParams(
            temperature=0.0, max_tokens=50, ignore_eos=True, grammar=GrammarSpec.json_schema({"enum": ["yes", "no"]})
        ),
    )[0]
    assert out.finish_reason == "stop"
    assert out.text in ('"yes"', '"no"')


def test_each_distinct_constraint_is_compiled_once(llama_with_tokenizer):
    engine = LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=256))
    schema = SCHEMAS[0][1]
    engine.generate([_prompt(engine)] * 3, _constrained(schema))
    engine.generate([_prompt(engine)], _constrained(schema))
    engine.generate([_prompt(engine)], _constrained(SCHEMAS[1][1]))
    assert engine.grammar_stats.compiles == 2
    assert engine.grammar_stats.cache_hits == 3


@pytest.mark.parametrize("garbage", [False, True], ids=["oracle", "garbage"])
def test_speculation_gives_identical_constrained_output(llama_with_tokenizer, garbage):
    plain = LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=512))
    prompt = _prompt(plain)
    schemas = [s for _, s in SCHEMAS[:6]]
    params = [_constrained(s) for s in schemas] + [SamplingParams(temperature=0.0, max_tokens=40)]
    expected = [c.token_ids for c in plain.generate([prompt] * len(params), params)]

    # The oracle proposes the true continuation; garbage proposes tokens the grammar mostly forbids.
    proposer = ScriptedProposer({f"req-{i}": t for i, t in enumerate(expected)}, garbage=garbage)
    spec = LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=512), drafter=Drafter(proposer, 4, ()))
    got = spec.generate([prompt] * len(params), params)
    assert [c.token_ids for c in got] == expected
    if garbage:
        # Forbidden drafts are cut before verification: constrained rows verify none of them.
        assert spec.stats.draft_tokens_accepted < spec.stats.draft_tokens_proposed
    else:
        assert spec.stats.draft_tokens_accepted == spec.stats.draft_tokens_proposed > 0


def test_preemption_keeps_constrained_output_identical(llama_with_tokenizer):
    roomy = LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=512))
    prompt = roomy.tokenizer.encode("Answer in JSON, please, with the fields the schema asks for: ")
    params = [_constrained(s) for _, s in SCHEMAS[12:18]]
    expected = [c.token_ids for c in roomy.generate([prompt] * len(params), params)]
    # Room for any one request, far from all six at once.
    tight = LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=32, block_size=8, enable_prefix_cache=False))
    got = tight.generate([prompt] * len(params), params)
    assert tight.stats.preemptions > 0
    assert [c.token_ids for c in got] == expected


def test_handed_off_first_token_continues_the_grammar(engine):
    prompt = _prompt(engine)
    params = _constrained(SCHEMAS[0][1])
    full = engine.generate([prompt], params)[0]
    rid = engine.add_request(prompt, params, first_token=full.token_ids[0])
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens.extend(out.new_token_ids)
    assert tokens == full.token_ids


def test_a_first_token_the_grammar_forbids_is_refused(engine):
    prompt = _prompt(engine)
    not_json = engine.tokenizer.encode("x")[0]
    with pytest.raises(InvalidArgument, match="not allowed by the request's grammar"):
        engine.add_request(prompt, _constrained({"type": "object"}), first_token=not_json)
    assert not engine.has_unfinished()


def test_bad_constraints_are_refused_at_admission(engine):
    with pytest.raises(InvalidArgument, match="keyword 'not'"):
        engine.add_request(_prompt(engine), _constrained({"not": {"type": "string"}}))
    with pytest.raises(InvalidArgument, match="regex: "):
        engine.add_request(
            _prompt(engine), SamplingParams(temperature=0.0, max_tokens=16, grammar=GrammarSpec("regex", "("))
        )
    assert not engine.has_unfinished()


def test_constraints_need_a_tokenizer(checkpoints):
    engine = LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=64))
    with pytest.raises(InvalidArgument, match="need a tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=16, grammar=GrammarSpec("any_json")))
