"""Chat with tools through the gateway core: the prompt shows them, the grammar travels with the request,
calls come back parsed; structured outputs are checked before anything is routed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import InvalidArgument, InvalidField
from kvmesh.structured.spec import GrammarSpec
from services.gateway.model import ServedModel
from services.gateway.tool_calls import FORMATS
from services.gateway.tool_calls.request import tool_use
from tests.gateway.fakes import DECODE_TOKENS, FIRST_TOKEN, FakeMesh
from tests.gateway.helpers import collect, make_gateway, request

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [gateway_pb2.Tool(name="get_weather", description="Weather now", parameters_json=json.dumps(WEATHER))]
ASK = [gateway_pb2.ChatMessage(role="user", content="Weather in Paris?")]
REQUIRED = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED)
NONE = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_NONE)


@pytest.fixture
def roomy(model: ServedModel) -> ServedModel:
    """The test model with room for a prompt that lists tools (the fake mesh runs no model)."""
    return dataclasses.replace(model, max_model_len=4096)


def chat(**fields) -> gateway_pb2.ChatRequest:
    return gateway_pb2.ChatRequest(**({"messages": ASK, "tools": TOOLS} | fields))


def scripted(mesh: FakeMesh, *texts: str) -> None:
    """The decode stream's texts, one per message: the first token's, then DECODE_TOKENS'."""
    tokens = [FIRST_TOKEN, *DECODE_TOKENS]
    assert len(texts) == len(tokens)
    mesh.token_text = dict(zip(tokens, texts)).__getitem__


async def test_the_prompt_lists_the_tools_and_the_request_carries_their_grammar(roomy) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(roomy, mesh)

    [c async for c in gateway.chat(chat(), "rid")]

    template_tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}
    ]
    text = roomy.tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=template_tools)
    assert "<tools>" in text
    assert list(mesh.routes[0].tokens.token_ids) == roomy.tokenizer.encode(text, add_special_tokens=False)
    [(_, decode)] = mesh.decodes
    expected = tool_use(chat(), FORMATS["hermes"]).grammar
    assert GrammarSpec.from_pb(decode.sampling.structured_output) == expected
    assert GrammarSpec.from_pb(mesh.prefills[0][1].sampling.structured_output) == expected


async def test_calls_come_back_parsed_with_fresh_ids_and_the_reply_ends_with_tool_calls(roomy) -> None:
    mesh = FakeMesh()
    scripted(
        mesh,
        "Checking.\n<tool_",
        'call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '{"city": "Rome"}}\n</tool_call>',
    )
    gateway = make_gateway(roomy, mesh)

    chunks = [c async for c in gateway.chat(chat(), "rid")]

    assert all(isinstance(c, gateway_pb2.ChatResponse) for c in chunks)
    assert [c.text for c in chunks] == ["Checking.", "", "", ""]
    assert [[(t.name, t.arguments) for t in c.tool_calls] for c in chunks] == [
        [],
        [("get_weather", '{"city": "Paris"}')],
        [],
        [("get_weather", '{"city": "Rome"}')],
    ]
    ids = [t.id for c in chunks for t in c.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert [len(c.token_ids) for c in chunks] == [1, 1, 1, 1]  # every token is counted, markup included
    assert chunks[-1].final.finish_reason == sampling_pb2.FINISH_REASON_TOOL_CALLS


async def test_a_reply_without_calls_keeps_its_text_and_finish_reason(roomy) -> None:
    mesh = FakeMesh()
    scripted(mesh, "It ", "is <tool", "box ", "time.\n")
    gateway = make_gateway(roomy, mesh)

    chunks = [c async for c in gateway.chat(chat(), "rid")]

    assert "".join(c.text for c in chunks) == "It is <toolbox time.\n"
    assert chunks[-1].final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH


async def test_tool_choice_none_leaves_tools_out_of_the_prompt_and_the_text_as_it_is(roomy) -> None:
    mesh = FakeMesh()
    scripted(mesh, "<tool_call>\n", '{"name": "get_weather", "arguments": {}}', "\n</tool_call>", "")
    gateway = make_gateway(roomy, mesh)

    chunks = [c async for c in gateway.chat(chat(tool_choice=NONE), "rid")]

    plain = roomy.tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}])
    assert list(mesh.routes[0].tokens.token_ids) == roomy.tokenizer.encode(plain, add_special_tokens=False)
    assert not mesh.decodes[0][1].sampling.HasField("structured_output")
    assert "".join(c.text for c in chunks).startswith("<tool_call>") and not any(c.tool_calls for c in chunks)


async def test_earlier_calls_and_tool_results_are_rendered_for_the_model(roomy) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(roomy, mesh)
    messages = [
        *ASK,
        gateway_pb2.ChatMessage(
            role="assistant",
            tool_calls=[gateway_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
        ),
        gateway_pb2.ChatMessage(role="tool", content="20 C", tool_call_id="call_1"),
    ]

    [c async for c in gateway.chat(chat(messages=messages), "rid")]

    prompt = roomy.tokenizer.decode(list(mesh.routes[0].tokens.token_ids), skip_special_tokens=False)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n20 C\n</tool_response><|im_end|>\n"
    ) in prompt


def json_output(schema: object) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(structured_output=sampling_pb2.StructuredOutput(json_schema=json.dumps(schema)))


@pytest.mark.parametrize(
    ("req", "field", "message"),
    [
        (chat(tools=[], tool_choice=REQUIRED), "tool_choice", "tool_choice is set but no tools are declared"),
        (
            chat(tool_choice=gateway_pb2.ToolChoice(function_name="get_time")),
            "tool_choice.function_name",
            "names the function 'get_time', which is not declared (tools: get_weather)",
        ),
        (chat(tools=[gateway_pb2.Tool(name="get weather")]), "tools[0].name", "must match ^[a-zA-Z0-9_-]{1,64}$"),
        (chat(tools=[*TOOLS, *TOOLS]), "tools[1].name", "'get_weather' is declared twice"),
        (
            chat(tools=[gateway_pb2.Tool(name="f", parameters_json="{")]),
            "tools[0].parameters_json",
            "tool 'f': parameters are not valid JSON",
        ),
        (
            chat(tools=[gateway_pb2.Tool(name="f", parameters_json='{"type": "object", "uniqueItems": true}')]),
            "tools[0].parameters_json",
            "keyword 'uniqueItems' is not supported",
        ),
        (chat(sampling=json_output({"type": "object"})), "sampling.structured_output", "cannot be combined with tools"),
        (
            chat(tools=[], sampling=json_output({"type": "object", "not": {}})),
            "sampling.structured_output",
            "structured output: json_schema: keyword 'not' is not supported",
        ),
        (
            chat(
                tools=[],
                messages=[
                    gateway_pb2.ChatMessage(
                        role="assistant", tool_calls=[gateway_pb2.ToolCall(id="c", name="f", arguments="[]")]
                    )
                ],
            ),
            "messages[0].tool_calls[0].arguments",
            "must be a JSON object",
        ),
    ],
)
async def test_bad_tools_and_grammars_are_refused_naming_the_field(roomy, req, field, message) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(roomy, mesh)

    with pytest.raises(InvalidField) as info:
        [c async for c in gateway.chat(req, "rid")]

    assert info.value.field == field and message in info.value.message
    assert mesh.routes == [] and gateway.inflight == 0


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (sampling_pb2.StructuredOutput(json_schema="{"), "json_schema is not valid JSON"),
        (sampling_pb2.StructuredOutput(json_schema='{"not": {}}'), "keyword 'not' is not supported"),
        (sampling_pb2.StructuredOutput(structural_tag="{"), "structural_tag is not valid JSON"),
    ],
)
async def test_a_generate_request_with_a_bad_grammar_is_refused(model, output, message) -> None:
    """What the gateway can tell without a grammar compiler; a regular expression or EBNF grammar that does
    not parse is refused by the worker that builds it (tests/structured, tests/e2e/test_structured)."""
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    req = request()
    req.sampling.structured_output.CopyFrom(output)

    with pytest.raises(InvalidArgument, match="structured output: .*" + message):
        await collect(gateway, req)

    assert mesh.routes == []


async def test_a_generate_request_with_a_good_grammar_carries_it_to_the_workers(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    req = request()
    req.sampling.structured_output.regex = "[a-z]+"

    await collect(gateway, req)

    assert mesh.decodes[0][1].sampling.structured_output.regex == "[a-z]+"
