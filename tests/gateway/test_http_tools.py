"""response_format, tools and tool calls through the OpenAI HTTP API (official client, fake mesh)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest

from kvmesh.structured.spec import GrammarSpec
from services.gateway.model import ServedModel
from services.gateway.tool_calls import FORMATS
from tests.gateway.fakes import DECODE_TOKENS, FIRST_TOKEN, FakeMesh
from tests.gateway.test_http_api import http_gateway

ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
# The fake decode stream, one text per message: two calls of get_weather after a few words.
CALLS_REPLY = [
    "On it.\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool',
    '_call>\n{"name": "get_weather", "arguments": ',
    '{"city": "Rome"}}\n</tool_call>',
]


@pytest.fixture
def roomy(model: ServedModel) -> ServedModel:
    """The test model with room for a prompt that lists tools (the fake mesh runs no model)."""
    return dataclasses.replace(model, max_model_len=4096)


def scripted(texts: list[str]) -> FakeMesh:
    mesh = FakeMesh()
    mesh.token_text = dict(zip([FIRST_TOKEN, *DECODE_TOKENS], texts)).__getitem__
    return mesh


def sent_grammar(mesh: FakeMesh) -> GrammarSpec | None:
    return GrammarSpec.from_pb(mesh.decodes[0][1].sampling.structured_output)


@pytest.mark.parametrize(
    ("response_format", "schema"),
    [
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER, "strict": True}}, WEATHER),
        ({"type": "json_schema", "json_schema": {"name": "anything"}}, {"type": "object"}),
    ],
)
async def test_a_response_format_becomes_the_requests_json_schema(model, response_format, schema) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh) as served:
        await served.client().chat.completions.create(model="tiny", messages=ASK, response_format=response_format)

    assert sent_grammar(mesh) == GrammarSpec.json_schema(schema)


async def test_a_text_response_format_sets_no_grammar(model) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh) as served:
        await served.client().chat.completions.create(model="tiny", messages=ASK, response_format={"type": "text"})

    assert sent_grammar(mesh) is None


async def test_a_reply_of_calls_only_has_null_content(roomy) -> None:
    mesh = scripted(["", CALLS_REPLY[1].removesuffix("\n<tool"), "", ""])
    async with http_gateway(roomy, mesh) as served:
        whole = await served.client().chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        )

    message = whole.choices[0].message
    assert message.content is None and [c.function.name for c in message.tool_calls] == ["get_weather"]
    tag = json.loads(sent_grammar(mesh).source)["format"]
    assert tag["type"] == "tags_with_separator" and tag["stop_after_first"] is True


async def test_tools_tool_choice_and_earlier_calls_reach_the_core(roomy) -> None:
    mesh = FakeMesh()
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "20 C", "tool_call_id": "call_1"},
    ]
    async with http_gateway(roomy, mesh) as served:
        await served.client().chat.completions.create(
            model="tiny",
            messages=conversation,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )

    tag = json.loads(sent_grammar(mesh).source)["format"]
    assert [t["begin"] for t in tag["tags"]] == ['<tool_call>\n{"name": "get_time", "arguments": ']
    # Declared without parameters: any object.
    assert tag["tags"][0]["content"] == {"type": "json_schema", "json_schema": {"type": "object"}}
    prompt = roomy.tokenizer.decode(list(mesh.routes[0].tokens.token_ids), skip_special_tokens=False)
    assert '"name": "get_time"' in prompt and "<tool_response>\n20 C\n</tool_response>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


# Two calls after some content, in each format, cut across the fake decode stream's messages.
FORMAT_REPLIES = {
    "hermes": CALLS_REPLY,
    "llama3_json": [
        "On it.\n",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"na',
        'me": "get_weather", "parameters": ',
        '{"city": "Rome"}}',
    ],
    "mistral": [
        "On it.\n[TOOL_",
        'CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ',
        '{"name": "get_weather", "arguments": ',
        '{"city": "Rome"}}]',
    ],
}
# The text that starts a call under tool_choice auto, first of each format's triggers.
TRIGGERS = {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]"}
# Mistral-7B-Instruct-v0.3's template, the part that renders earlier calls and results (it refuses other ids).
MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "user" %}{{- "[INST] " + message.content + "[/INST]" }}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
    {{- "[TOOL_CALLS] [" }}
    {%- for tool_call in message.tool_calls %}
        {%- set out = tool_call.function|tojson %}
        {{- out[:-1] }}
        {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- ', "id": "' + tool_call.id + '"}' }}
        {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
    {%- endfor %}
{%- elif message.role == "tool" %}
    {{- '[TOOL_RESULTS] {"content": ' + message.content|string + ", " }}
    {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
        {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
    {%- endif %}
    {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
async def test_calls_in_each_format_are_the_messages_tool_calls_and_stream_as_deltas(roomy, fmt) -> None:
    mesh = scripted(FORMAT_REPLIES[fmt])
    async with http_gateway(roomy, mesh, tool_call_format=FORMATS[fmt]) as served:
        client = served.client()
        whole = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        stream = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True)
        chunks = [c async for c in stream]

    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "On it."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_weather", {"city": "Rome"}),
    ]
    id_form = r"[A-Za-z0-9]{9}" if fmt == "mistral" else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(id_form, c.id) for c in calls) and calls[0].id != calls[1].id
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "On it."
    streamed = [t for d in deltas for t in d.tool_calls or ()]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The format's grammar went to the workers.
    tag = json.loads(sent_grammar(mesh).source)["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"][0] == TRIGGERS[fmt]


async def test_mistral_call_ids_go_back_through_mistrals_template(roomy) -> None:
    tokenizer = copy.copy(roomy.tokenizer)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    mistral_model = dataclasses.replace(roomy, tokenizer=tokenizer)
    mesh = scripted(FORMAT_REPLIES["mistral"])
    async with http_gateway(mistral_model, mesh, tool_call_format=FORMATS["mistral"]) as served:
        client = served.client()
        first = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        calls = first.choices[0].message.tool_calls
        conversation = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
            *({"role": "tool", "content": "20 C", "tool_call_id": c.id} for c in calls),
        ]
        await client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS)

    prompt = roomy.tokenizer.decode(list(mesh.routes[1].tokens.token_ids), skip_special_tokens=False)
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{calls[0].id}"}}' in prompt
    assert f'"call_id": "{calls[1].id}"}}[/TOOL_RESULTS]' in prompt
