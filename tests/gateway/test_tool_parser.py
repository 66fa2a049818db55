"""The Hermes tool-call parser: calls out of the text, whatever way the text is split into chunks."""

from __future__ import annotations

import json
import random

import pytest

from services.gateway.tool_calls.format import ParsedCall
from services.gateway.tool_calls.hermes import CALL_SUFFIX, HermesParser, call_prefix
from tests.gateway.tool_helpers import read_reply, splits


def call(name: str, arguments: dict) -> str:
    """A call as the grammar makes the model write it."""
    return call_prefix(name) + json.dumps(arguments) + CALL_SUFFIX


def parse(chunks: list[str]) -> tuple[str, list[ParsedCall]]:
    return read_reply(HermesParser(), chunks)


WEATHER = call("get_weather", {"city": "Paris", "days": 3})
REPLIES = [
    "Just text, no calls.\n",
    WEATHER,
    "Checking.\n" + WEATHER + "\n" + call("get_time", {"zone": "CET"}),
    WEATHER + "\nDone: 20 C.",
    "a < b and <tool is not a call; nor is <tool_call",
    '<tool_call>\n{"name": "f", "arguments": {"x": "</tool"}}',  # ends inside a call
    "<tool_call>\nnot json\n</tool_call> then text",
    "x" + call("f", {"s": "<tool_call>"}),
]


def test_a_call_becomes_name_and_arguments_and_its_markup_is_not_content() -> None:
    content, calls = parse([WEATHER])

    assert content == ""
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "days": 3}')]


def test_text_without_calls_comes_out_unchanged() -> None:
    for text in ("hello\n", "  indented\n\n", "a < b <tool", "<tool_call"):
        assert parse([text]) == (text, [])


def test_text_around_calls_is_content_without_the_whitespace_that_lays_them_out() -> None:
    content, calls = parse(["Checking.\n" + WEATHER + "\n" + call("get_time", {}) + "\n\nDone."])

    assert content == "Checking.Done."
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_a_call_split_anywhere_across_chunks_is_the_same_call() -> None:
    whole = parse(["Hi " + WEATHER])

    assert whole == ("Hi", [ParsedCall("get_weather", '{"city": "Paris", "days": 3}')])
    for cut in range(1, len(WEATHER)):
        assert parse(["Hi " + WEATHER[:cut], WEATHER[cut:]]) == whole, cut


def test_text_that_might_start_a_call_is_held_back_until_it_is_known() -> None:
    parser = HermesParser()

    assert parser.feed("Sure <tool") == ["Sure"]
    assert parser.feed("box") == [" <toolbox"]
    assert parser.feed(" <tool_") == []
    assert parser.feed('call>\n{"name": "f", "arguments": {}}\n</tool_') == []
    assert parser.feed("call>") == [ParsedCall("f", "{}")]
    assert parser.finish() == []


def test_every_way_of_chunking_a_reply_parses_the_same() -> None:
    rng = random.Random(7)
    for reply in REPLIES:
        whole = parse([reply])
        for _ in range(40):
            assert parse(splits(reply, rng)) == whole, reply


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"name": "f"}',  # no arguments
        '{"name": "f", "arguments": "{}"}',  # arguments as a string
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": {}, "extra": 1}',
        '["f", {}]',
    ],
)
def test_a_malformed_call_stays_content_markup_and_all(body) -> None:
    block = f"<tool_call>\n{body}\n</tool_call>"

    assert parse(["Before ", block, " after"]) == (f"Before {block} after", [])


def test_output_that_ends_inside_a_call_is_content() -> None:
    unfinished = '<tool_call>\n{"name": "f", "arguments": {"x": 1'

    assert parse([WEATHER, "\n", unfinished]) == (
        unfinished,
        [ParsedCall("get_weather", '{"city": "Paris", "days": 3}')],
    )


def test_a_raw_control_character_in_an_argument_comes_out_escaped() -> None:
    [parsed] = parse([call_prefix("f") + '{"s": "a\x15b"}' + CALL_SUFFIX])[1]

    assert parsed.arguments == '{"s": "a\\u0015b"}' and json.loads(parsed.arguments) == {"s": "a\x15b"}


def test_arguments_keep_non_ascii_text() -> None:
    [parsed] = parse([call("greet", {"name": "Zoë"})])[1]

    assert json.loads(parsed.arguments) == {"name": "Zoë"} and "Zoë" in parsed.arguments
