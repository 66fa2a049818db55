"""The grammar a chat request's tools compile to: what it lets the model write, per tool choice."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.structured.spec import GrammarSpec
from services.gateway.tool_calls import FORMATS
from services.gateway.tool_calls.hermes import CALL_SUFFIX, HermesParser, call_prefix
from services.gateway.tool_calls.request import tool_use
from tests.gateway.tool_helpers import AUTO, NAMED, REQUIRED, TOOLS, WEATHER, accepts
from tests.gateway.tool_helpers import grammar as tool_grammar


def call(name: str, arguments: dict) -> str:
    return call_prefix(name) + json.dumps(arguments, ensure_ascii=False) + CALL_SUFFIX


PARIS = call("get_weather", {"city": "Paris", "days": 3})
CET = call("get_time", {"zone": "CET"})


def grammar(choice: gateway_pb2.ToolChoice | None = None, parallel: bool | None = None) -> GrammarSpec:
    return tool_grammar("hermes", choice, parallel)


BAD_CALLS = [
    call("get_stock", {"ticker": "X"}),  # an undeclared tool
    call("get_weather", {"city": "Paris"}),  # a required argument missing
    call("get_weather", {"city": "Paris", "days": 9}),  # out of range
    call("get_weather", {"city": "Paris", "days": 3, "hourly": True}),  # not allowed
    call("get_time", {"zone": "PST"}),  # not in the enum
]


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        (None, None, "No call needed.", True),
        (AUTO, None, "", True),
        (AUTO, None, "Let me check. " + PARIS, True),
        (AUTO, None, PARIS + "\n" + CET + "\nBoth done.", True),
        (AUTO, False, "Let me check. " + PARIS, True),
        (AUTO, False, PARIS + "\n" + CET, False),  # at most one call
        (REQUIRED, None, "No call needed.", False),
        (REQUIRED, None, "", False),
        (REQUIRED, None, PARIS, True),
        (REQUIRED, None, PARIS + "\n" + CET, True),
        (REQUIRED, None, "Sure. " + PARIS, False),  # calls only
        (REQUIRED, None, PARIS + " Done.", False),
        (REQUIRED, False, PARIS + "\n" + CET, False),
        (NAMED, None, CET, True),
        (NAMED, None, PARIS, False),
        (NAMED, None, CET + "\n" + CET, False),
        (REQUIRED, None, PARIS.replace(', "days"', ',\n"days"'), False),  # compact JSON: no other whitespace
        (REQUIRED, None, PARIS.replace(', "days": ', ',"days":'), False),
    ],
)
def test_what_each_tool_choice_allows(choice, parallel, text, ok) -> None:
    assert accepts(grammar(choice, parallel), text) is ok


@pytest.mark.parametrize("choice", [AUTO, REQUIRED], ids=["auto", "required"])
@pytest.mark.parametrize("bad", BAD_CALLS)
def test_a_call_of_an_undeclared_tool_or_with_invalid_arguments_cannot_be_written(choice, bad) -> None:
    assert not accepts(grammar(choice), bad)
    assert not accepts(grammar(choice), "Sure. " + bad)


def test_every_call_the_grammar_allows_parses_back_and_validates() -> None:
    spec = grammar(REQUIRED)
    for arguments in ({"city": "Paris", "days": 3}, {"city": "", "days": 7}, {"city": "São Paulo", "days": 1}):
        text = call("get_weather", arguments)
        assert accepts(spec, text)
        parser = HermesParser()
        [parsed] = parser.feed(text) + parser.finish()
        jsonschema.validate(json.loads(parsed.arguments), WEATHER)


def test_the_structural_tag_is_plain_json_xgrammar_compiles() -> None:
    tag = json.loads(grammar(AUTO).source)

    assert tag["type"] == "structural_tag" and tag["format"]["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in tag["format"]["tags"]] == [call_prefix("get_weather"), call_prefix("get_time")]
    xgr.Grammar.from_structural_tag(grammar(AUTO).source)
    xgr.Grammar.from_structural_tag(grammar(REQUIRED, parallel=False).source)


def test_tool_choice_none_asks_for_no_grammar() -> None:
    none = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_NONE)

    assert tool_use(gateway_pb2.ChatRequest(tools=TOOLS, tool_choice=none), FORMATS["hermes"]) is None
    assert tool_use(gateway_pb2.ChatRequest(), FORMATS["hermes"]) is None
