"""Which schemas are refused, and that every keyword we accept is really enforced by the grammar."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from kvmesh.engine.grammar import GrammarCache
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidArgument
from kvmesh.structured.grammar import build as build_grammar
from kvmesh.structured.json_schema import ENFORCED
from kvmesh.structured.spec import GrammarSpec
from tests.structured.schemas import SCHEMAS


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"not": {"type": "string"}}, "keyword 'not' is not supported (at /not)"),
        ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "keyword 'if'"),
        ({"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}},
         "keyword 'uniqueItems' is not supported (at /properties/t/uniqueItems)"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "keyword 'dependentRequired'"),
        ({"type": "object", "patternProperties": {"^a": {}}}, "keyword 'patternProperties'"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "keyword 'oneOf'"),
        ({"type": "array", "contains": {"type": "string"}}, "keyword 'contains'"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' with more than one subschema"),
        ({"type": "number", "multipleOf": 0.5}, "'multipleOf' is supported only as a whole number"),
        ({"type": "string", "format": "iri"}, "format 'iri' is not supported"),
        ({"type": "string", "format": "email", "maxLength": 9}, "'format' together with minLength/maxLength"),
        ({"const": {"a": 1}}, "'const' with object or array values"),
        ({"$ref": "https://example.com/s.json"}, "only local references"),
        ({"type": "strin"}, "not a valid JSON Schema at /type"),
        ({"type": "integer", "minimum": "3"}, "not a valid JSON Schema at /minimum"),
        ({"type": "object", "minProperties": 2}, "json_schema: "),  # xgrammar: none could ever be valid
    ],
)  # fmt: skip
def test_unenforceable_or_invalid_schemas_are_refused_with_what_and_where(schema, says):
    with pytest.raises(InvalidArgument) as e:
        build_grammar(GrammarSpec.json_schema(schema))
    assert says in e.value.message


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GrammarSpec("regex", "[a-"), "regex: Regex parsing error"),
        (
            GrammarSpec("ebnf", "root ::= foo"),
            'ebnf: EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
        (GrammarSpec("structural_tag", "{}"), "structural_tag: "),
        (GrammarSpec("structural_tag", "not json"), "structural_tag is not valid JSON"),
        (GrammarSpec("json_schema", "[1,"), "json_schema is not valid JSON"),
        (GrammarSpec("json_schema", "[1]"), "json_schema must be a JSON object"),
    ],
)
def test_bad_grammars_are_refused_without_a_cpp_trace(spec, says):
    with pytest.raises(InvalidArgument) as e:
        build_grammar(spec)
    assert e.value.message.startswith(says)
    assert ".cc:" not in e.value.message


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GrammarSpec("structural_tag", "not json"), "structural_tag is not valid JSON"),
        (GrammarSpec("json_schema", "[1,"), "json_schema is not valid JSON"),
        (GrammarSpec.json_schema({"type": "array", "uniqueItems": True}), "keyword 'uniqueItems' is not supported"),
        (
            GrammarSpec("structural_tag", json.dumps({"type": "json_schema", "json_schema": {"not": {}}})),
            "keyword 'not' is not supported",
        ),
    ],
)
def test_the_gateway_check_refuses_what_it_can_tell_without_a_grammar_compiler(spec, says):
    with pytest.raises(InvalidArgument) as e:
        spec.check()
    assert e.value.message.startswith(says) or says in e.value.message
    for parsed_by_workers in (GrammarSpec("regex", "[a-"), GrammarSpec("ebnf", "root ::= foo")):
        parsed_by_workers.check()  # no xgrammar here: the worker that builds it refuses it


@pytest.fixture(scope="module")
def cache(tokenizer_path) -> GrammarCache:
    tok = Tokenizer(tokenizer_path)
    return GrammarCache(tok, tok.vocab_size, [tok.eos_token_id])


def _accepts(cache: GrammarCache, schema: dict, text: str) -> bool:
    m = xgr.GrammarMatcher(cache.compiled(GrammarSpec.json_schema(schema)))
    return m.accept_string(text) and m.is_completed()


# For every keyword the checker lets through: a schema using it, an instance the grammar must
# accept, and one that breaks only that keyword, which it must refuse.
ENFORCEMENT = {
    "type": ({"type": "integer"}, "3", '"3"'),
    "enum": ({"enum": ["a", 1]}, "1", '"b"'),
    "const": ({"const": "v1"}, '"v1"', '"v2"'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": "x"}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties": ({"type": "object", "additionalProperties": False}, "{}", '{"a": 1}'),
    "minProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, '{"a": 1}', "{}"),
    "maxProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, '{"a": 1}',
                      '{"a": 1, "b": 2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1, 2]", '[1, "x"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    '[1, "x"]', '["x", 1]'),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2}$"}, '"ab"', '"abc"'),
    "format": ({"type": "string", "format": "date"}, '"2026-11-29"', '"tomorrow"'),
    "minimum": ({"type": "integer", "minimum": 3}, "3", "2"),
    "maximum": ({"type": "number", "maximum": 2.5}, "2.5", "2.6"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 3}, "2.5", "3"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", "null"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}]}, "5", "1"),
    "$ref": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
              "$defs": {"A": {"type": "integer"}}}, '{"a": 1}', '{"a": "x"}'),
    "definitions": ({"$ref": "#/definitions/A", "definitions": {"A": {"type": "boolean"}}}, "true", "1"),
    "$defs": ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "boolean"}}}, "false", '"x"'),
}  # fmt: skip


def test_every_accepted_keyword_has_an_enforcement_case():
    assert set(ENFORCEMENT) == set(ENFORCED)


@pytest.mark.parametrize("keyword", sorted(ENFORCEMENT))
def test_accepted_keyword_is_enforced(cache, keyword):
    schema, good, bad = ENFORCEMENT[keyword]
    GrammarSpec.json_schema(schema).check()
    assert _accepts(cache, schema, good)
    assert not _accepts(cache, schema, bad)


def test_bounded_strings_refuse_raw_control_characters(cache):
    # xgrammar's own grammar for a maxLength string lets them through; JSON forbids them unescaped.
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 10}}, "required": ["k"]}
    assert _accepts(cache, schema, '{"k": "ab"}')
    assert not _accepts(cache, schema, '{"k": "a\x08"}')
    assert not _accepts(cache, schema, '{"k": "a\n"}')


def test_the_shared_schema_corpus_is_all_accepted():
    assert len(SCHEMAS) >= 20
    for _, schema in SCHEMAS:
        GrammarSpec.json_schema(schema).check()
        assert json.dumps(schema)  # plain JSON: the API and the benchmark send them as-is
