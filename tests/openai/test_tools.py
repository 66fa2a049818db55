"""Tool calling through a mesh of real processes (random weights), with the official openai client.

The model knows nothing of tools: whatever it writes, the grammar makes every call it makes
name a declared tool with arguments that validate. The test model's context is small (512
tokens) and its tokenizer nearly character-level on JSON, so the tools are tiny, and their strings
ASCII (a character outside it can take several tokens).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.openai.conftest import MODEL

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
WEATHER_TOOL = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
BOTH_TOOLS = [*WEATHER_TOOL, {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
ASK = [{"role": "user", "content": "Hi"}]
# A call takes up to 69 tokens: room for two after the prompt with one tool (~310 tokens), for one
# after a prompt with both tools or a longer conversation (~430).
MAX_TOKENS = {1: 150, 2: 80}
SEEDS = range(6)


def valid_calls(message, tools: list[dict]) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its tool."""
    declared = {t["function"]["name"] for t in tools}
    calls = []
    for call in message.tool_calls or ():
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in declared
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


async def _create(aclient, tools: list[dict], **kwargs):
    kwargs = {"messages": ASK, "max_tokens": MAX_TOKENS[len(tools)]} | kwargs
    return await aclient.chat.completions.create(model=MODEL, tools=tools, **kwargs)


async def test_tool_choice_required_always_yields_valid_calls(aclient) -> None:
    replies = await asyncio.gather(*(
        _create(aclient, tools, tool_choice="required", temperature=1.0, seed=seed)
        for tools in (WEATHER_TOOL, BOTH_TOOLS) for seed in SEEDS
    ))  # fmt: skip

    for reply in replies:
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert valid_calls(choice.message, BOTH_TOOLS)


async def test_a_named_function_is_called_exactly_once(aclient) -> None:
    named = {"type": "function", "function": {"name": "clock"}}
    replies = await asyncio.gather(*(
        _create(aclient, BOTH_TOOLS, tool_choice=named, temperature=1.0, seed=seed) for seed in SEEDS
    ))  # fmt: skip

    for reply in replies:
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [(name, _)] = valid_calls(choice.message, BOTH_TOOLS)
        assert name == "clock"


async def test_without_parallel_calls_a_required_reply_is_one_call(aclient) -> None:
    replies = await asyncio.gather(*(
        _create(aclient, WEATHER_TOOL, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
        for seed in SEEDS
    ))  # fmt: skip

    for reply in replies:
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(valid_calls(choice.message, WEATHER_TOOL)) == 1


async def test_with_tool_choice_auto_any_call_made_is_valid(aclient) -> None:
    replies = await asyncio.gather(*(
        _create(aclient, WEATHER_TOOL, temperature=1.0, seed=seed) for seed in SEEDS
    ))  # fmt: skip

    for reply in replies:
        [choice] = reply.choices
        calls = valid_calls(choice.message, WEATHER_TOOL)
        assert (choice.finish_reason == "tool_calls") == bool(calls)


async def test_streamed_calls_equal_the_whole_reply(aclient) -> None:
    async def both(tools: list[dict], **kwargs) -> None:
        whole = (await _create(aclient, tools, temperature=0, **kwargs)).choices[0]
        chunks = [c async for c in await _create(aclient, tools, temperature=0, stream=True, **kwargs)]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = [t for d in deltas for t in d.tool_calls or ()]
        assert [t.index for t in streamed] == list(range(len(streamed)))
        assert [(t.function.name, t.function.arguments) for t in streamed] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()
        ]
        assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason

    await asyncio.gather(
        both(WEATHER_TOOL, tool_choice="required"), both(BOTH_TOOLS, tool_choice="required"), both(WEATHER_TOOL)
    )


async def test_a_conversation_with_earlier_calls_and_their_results(aclient) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
    ]
    # Greedy: a sampled call may spell its 8-letter city in more tokens than the context leaves room for.
    reply = await _create(
        aclient,
        WEATHER_TOOL,
        messages=messages,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )

    assert len(valid_calls(reply.choices[0].message, WEATHER_TOOL)) == 1


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "stock"}}, "tools": BOTH_TOOLS},
            "tool_choice",
            "names the function 'stock', which is not declared (tools: weather, clock)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no tools are declared"),
        (
            {"tools": WEATHER_TOOL, "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined with tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
            "tools.0.function.parameters",
            "keyword 'not' is not supported",
        ),
        ({"tools": WEATHER_TOOL * 2}, "tools.1.function.name", "declared twice"),
    ],
)
def test_bad_tools_are_400_naming_the_parameter(client, kwargs, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)

    error = info.value.response.json()["error"]
    assert error["param"] == param and message in error["message"]
