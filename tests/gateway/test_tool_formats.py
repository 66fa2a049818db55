"""The Llama 3.x JSON and Mistral tool-call formats (their grammar and parser), and picking a format from
the chat template."""

from __future__ import annotations

import json
import random
import re

import pytest
import xgrammar as xgr

from kvmesh.models.chatml import CHAT_TEMPLATE
from services.gateway.tool_calls import FORMATS, chosen_format, format_for
from services.gateway.tool_calls.format import ParsedCall
from tests.gateway.tool_helpers import AUTO, NAMED, REQUIRED, accepts, grammar, read_reply, splits

PARIS_ARGS = {"city": "Paris", "days": 3}
CET_ARGS = {"zone": "CET"}
PARIS_CALL = ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
CET_CALL = ParsedCall("get_time", '{"zone": "CET"}')


def llama(name: str, arguments: dict) -> str:
    """A call as Llama 3.1's template renders one (and the grammar makes the model write it)."""
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def mistral(*calls: tuple[str, dict], marker: str = "[TOOL_CALLS] ") -> str:
    """Calls as Mistral-7B-Instruct-v0.3's template renders them (without the ids it appends)."""
    return marker + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def parse(fmt: str, chunks: list[str]) -> tuple[str, list[ParsedCall]]:
    return read_reply(FORMATS[fmt].parser(), chunks)


# -- Llama 3.x JSON -------------------------------------------------------------

PARIS = llama("get_weather", PARIS_ARGS)
CET = llama("get_time", CET_ARGS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PARIS, ("", [PARIS_CALL])),
        ("<|python_tag|>" + PARIS, ("", [PARIS_CALL])),
        (PARIS + "; " + CET, ("", [PARIS_CALL, CET_CALL])),  # Llama 3.2's several calls
        ("<|python_tag|>" + PARIS + "; " + CET, ("", [PARIS_CALL, CET_CALL])),
        ("Let me check.\n" + PARIS, ("Let me check.", [PARIS_CALL])),
        ('{"name": "f", "arguments": {}}', ("", [ParsedCall("f", "{}")])),  # vLLM reads "arguments" too
        ("Plain text, no calls.\n", ("Plain text, no calls.\n", [])),
        ('a {"name": "Bob", "age": 3} b', ('a {"name": "Bob", "age": 3} b', [])),  # JSON that is no call
        ('{"name":"f","parameters":{}}', ('{"name":"f","parameters":{}}', [])),  # not the grammar's: free text
        ('{"name": "f", "parameters": "x"}', ('{"name": "f", "parameters": "x"}', [])),
        ('{"name": "f", "parameters": {}, "x": 1}', ('{"name": "f", "parameters": {}, "x": 1}', [])),
        ("<|python_tag|>brave_search.call(query='x')", ("<|python_tag|>brave_search.call(query='x')", [])),
        ('{"name": "f", "parameters": {"x": "}', ('{"name": "f", "parameters": {"x": "}', [])),  # unfinished
        (llama("f", {"s": '}{"name": ;'}), ("", [ParsedCall("f", '{"s": "}{\\"name\\": ;"}')])),
        (llama("f", {"s": 'a"}]\\'}), ("", [ParsedCall("f", '{"s": "a\\"}]\\\\"}')])),  # escapes in strings
    ],
)
def test_llama3_calls_are_read_and_anything_else_stays_content(text, expected) -> None:
    assert parse("llama3_json", [text]) == expected


def test_llama3_every_way_of_chunking_a_reply_parses_the_same() -> None:
    rng = random.Random(3)
    for reply in ("Hi " + PARIS + "; " + CET + " done", "<|python_tag|>" + PARIS, 'x {"name": 1} <|python', PARIS):
        whole = parse("llama3_json", [reply])
        for _ in range(40):
            assert parse("llama3_json", splits(reply, rng)) == whole, reply


def test_llama3_text_that_might_start_a_call_is_held_back() -> None:
    parser = FORMATS["llama3_json"].parser()

    assert parser.feed('Sure {"na') == ["Sure"]
    assert parser.feed("p") == [' {"nap']
    assert parser.feed('{"name": "get_time", "parameters": {"zone": "CET"') == []
    assert parser.feed("}}") == [CET_CALL]


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        (AUTO, None, "No call needed.", True),
        (AUTO, None, "Let me check. " + PARIS, True),
        (AUTO, None, PARIS + "; " + CET, True),
        (AUTO, None, "<|python_tag|>" + PARIS, True),
        (AUTO, False, PARIS + "; " + CET, False),
        (REQUIRED, None, PARIS, True),
        (REQUIRED, None, "<|python_tag|>" + PARIS + "; " + CET, True),
        (REQUIRED, None, "Sure. " + PARIS, False),
        (REQUIRED, None, "No call needed.", False),
        (REQUIRED, None, PARIS + ";" + CET, False),  # "; " between calls
        (REQUIRED, False, PARIS + "; " + CET, False),
        (NAMED, None, CET, True),
        (NAMED, None, PARIS, False),
    ],
)
def test_llama3_what_each_tool_choice_allows(choice, parallel, text, ok) -> None:
    assert accepts(grammar("llama3_json", choice, parallel), text) is ok


@pytest.mark.parametrize("choice", [AUTO, REQUIRED], ids=["auto", "required"])
@pytest.mark.parametrize(
    "bad",
    [
        llama("get_stock", {"ticker": "X"}),  # an undeclared tool
        llama("get_weather", {"city": "Paris"}),  # a required argument missing
        llama("get_time", {"zone": "PST"}),
        json.dumps({"name": "get_time", "arguments": CET_ARGS}),  # the grammar writes "parameters"
    ],
)
def test_llama3_a_call_of_an_undeclared_tool_or_with_invalid_arguments_cannot_be_written(choice, bad) -> None:
    assert not accepts(grammar("llama3_json", choice), bad)
    assert not accepts(grammar("llama3_json", choice), "<|python_tag|>" + bad)


# -- Mistral [TOOL_CALLS] --------------------------------------------------------

UNFINISHED = '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "]'
TWO = mistral(("get_weather", PARIS_ARGS), ("get_time", CET_ARGS))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (mistral(("get_weather", PARIS_ARGS)), ("", [PARIS_CALL])),
        (TWO, ("", [PARIS_CALL, CET_CALL])),
        (mistral(("get_time", CET_ARGS), marker="[TOOL_CALLS]"), ("", [CET_CALL])),  # Mistral-Nemo's spelling
        (mistral(("get_time", CET_ARGS), marker=""), ("", [CET_CALL])),  # the marker skipped as a special token
        ("Let me see.\n" + TWO, ("Let me see.", [PARIS_CALL, CET_CALL])),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "a1b2c3d4e"}]', ("", [ParsedCall("f", "{}")])),
        ("Just text [1, 2].", ("Just text [1, 2].", [])),
        ("[TOOL_CALLS] no list", ("[TOOL_CALLS] no list", [])),
        ("[TOOL_CALLS] []", ("[TOOL_CALLS] []", [])),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, 3]', ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, 3]', [])),
        ('[TOOL_CALLS] [{"name": "f", "parameters": {}}]', ('[TOOL_CALLS] [{"name": "f", "parameters": {}}]', [])),
        (
            '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "]',
            ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": "]', []),
        ),
    ],
)
def test_mistral_calls_are_read_and_anything_else_stays_content(text, expected) -> None:
    assert parse("mistral", [text]) == expected


def test_mistral_every_way_of_chunking_a_reply_parses_the_same() -> None:
    rng = random.Random(5)
    for reply in ("Hi " + TWO, TWO, "[TOOL_CALLS] oops [1]", mistral(("f", {"s": "]}[TOOL_CALLS]"}))):
        whole = parse("mistral", [reply])
        for _ in range(40):
            assert parse("mistral", splits(reply, rng)) == whole, reply


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        (AUTO, None, "No call needed.", True),
        (AUTO, None, TWO, True),
        (AUTO, None, "Let me see. " + TWO, True),
        (AUTO, None, mistral(("get_time", CET_ARGS), marker="[TOOL_CALLS]"), True),
        (AUTO, None, TWO + " and more text", False),  # the reply ends with the list
        (AUTO, None, "A list: " + mistral(("get_time", CET_ARGS), marker=""), False),  # no calls without the grammar
        (AUTO, False, TWO, False),
        (AUTO, False, mistral(("get_time", CET_ARGS)), True),
        (REQUIRED, None, TWO, True),
        (REQUIRED, None, "Sure. " + TWO, False),
        (REQUIRED, None, "[TOOL_CALLS] []", False),
        (REQUIRED, False, TWO, False),
        (NAMED, None, mistral(("get_time", CET_ARGS)), True),
        (NAMED, None, mistral(("get_weather", PARIS_ARGS)), False),
    ],
)
def test_mistral_what_each_tool_choice_allows(choice, parallel, text, ok) -> None:
    assert accepts(grammar("mistral", choice, parallel), text) is ok


@pytest.mark.parametrize("choice", [AUTO, REQUIRED], ids=["auto", "required"])
@pytest.mark.parametrize(
    "bad",
    [
        mistral(("get_stock", {"ticker": "X"})),  # an undeclared tool
        mistral(("get_time", CET_ARGS), ("get_stock", {})),
        mistral(("get_weather", {"city": "Paris"})),  # a required argument missing
        mistral(("get_time", {"zone": "PST"})),
    ],
)
def test_mistral_a_call_of_an_undeclared_tool_or_with_invalid_arguments_cannot_be_written(choice, bad) -> None:
    assert not accepts(grammar("mistral", choice), bad)


def test_mistral_call_ids_are_nine_alphanumerics_and_fresh() -> None:
    ids = {FORMATS["mistral"].new_call_id() for _ in range(50)}

    assert len(ids) == 50 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert FORMATS["llama3_json"].new_call_id().startswith("call_")


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", [AUTO, REQUIRED, NAMED], ids=["auto", "required", "named"])
def test_every_formats_structural_tag_compiles_in_xgrammar(fmt, choice) -> None:
    for parallel in (True, False):
        xgr.Grammar.from_structural_tag(grammar(fmt, choice, parallel).source)


# -- choosing the format ---------------------------------------------------------

# The parts of the templates that tell the formats apart, as the Hub's tokenizer_config.json files have them.
LLAMA_3_1 = """{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{%- if builtin_tools is defined and tool_call.name in builtin_tools %}
    {{- "<|python_tag|>" + tool_call.name + ".call(" }}
{%- else %}
    {{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
{%- endif %}"""
LLAMA_3_2 = """{{- "Given the following functions, please respond with a JSON for a function call " }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}"""
MISTRAL_V03 = """{%- elif message.tool_calls is defined and message.tool_calls is not none %}
    {{- "[TOOL_CALLS] [" }}
    {%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"""
QWEN_2_5 = """{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>,
\\"arguments\\": <args-json-object>}\\n</tool_call>" }}"""
PLAIN = "{% for message in messages %}<|im_start|>{{ message.role }}\\n{{ message.content }}<|im_end|>\\n{% endfor %}"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (LLAMA_3_1, "llama3_json"),
        (LLAMA_3_2, "llama3_json"),
        (MISTRAL_V03, "mistral"),
        (QWEN_2_5, "hermes"),
        (CHAT_TEMPLATE, "hermes"),  # kvmesh's own
        (PLAIN, "hermes"),  # no tools taught: the default
        (None, "hermes"),
    ],
)
def test_the_format_is_the_one_the_chat_template_writes(template, fmt) -> None:
    assert format_for(template).name == fmt
    assert chosen_format("auto", template).name == fmt


def test_a_format_named_by_the_flag_wins_over_the_template() -> None:
    assert chosen_format("hermes", MISTRAL_V03).name == "hermes"
    assert chosen_format("mistral", LLAMA_3_1).name == "mistral"


def test_the_gateway_flag_is_auto_unless_a_format_is_named() -> None:
    from kvmesh.runtime import parse_flags
    from services.gateway.main import FLAGS

    def flag(*argv: str) -> str:
        return parse_flags("kvmesh-gateway", FLAGS, ["--router-address", "x:1", *argv], environ={}).tool_call_format

    assert flag() == "auto"
    assert [flag("--tool-call-format", f) for f in FORMATS] == list(FORMATS)
    with pytest.raises(SystemExit):
        flag("--tool-call-format", "pythonic")


@pytest.mark.parametrize(
    ("fmt", "reply", "bad"),
    [
        ("llama3_json", "Sure. " + PARIS + "; " + CET, llama("get_stock", {})),
        ("mistral", "Sure. " + TWO, mistral(("get_stock", {}))),
    ],
)
def test_a_workers_compiled_grammar_takes_the_calls_token_by_token(model_dir, fmt, reply, bad) -> None:
    """As the workers compile it, against a tokenizer's vocabulary, and feed it sampled tokens."""
    from kvmesh.engine.grammar import GrammarCache
    from kvmesh.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    cache = GrammarCache(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])

    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(cache.compiled(grammar(fmt, AUTO)))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(tokenizer.eos_token_id)

    assert takes(reply)
    assert not takes(bad)
