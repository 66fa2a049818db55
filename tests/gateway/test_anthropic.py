"""Anthropic Messages without a server: the body's checks, its translation to a ChatRequest, the rendering of
the core's chunks (events and message), and the error shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvmesh.api.common.v1 import accounting_pb2, sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import NotFound, ResourceExhausted, Unauthenticated, Unavailable
from services.gateway.anthropic_errors import anthropic_error_body
from services.gateway.anthropic_render import MessageRenderer, fired_stop
from services.gateway.anthropic_requests import MessagesRequest
from services.gateway.anthropic_translate import chat_request
from services.gateway.openai_errors import ParamError

ASK = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}


def parse(body: dict) -> MessagesRequest:
    return MessagesRequest.model_validate_json(json.dumps(body))


def refusal(body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        parse(body)
    return ParamError.from_validation(info.value).message


def test_a_conversation_with_tools_becomes_a_chat_request() -> None:
    body = ASK | {
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "down", "is_error": True},
                    {"type": "text", "text": "And Rome?"},
                ],
            },
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0,
        "top_k": 5,
        "metadata": {"user_id": "u-1"},
    }
    chat = chat_request(parse(body))

    assert [(m.role, m.content, m.tool_call_id) for m in chat.messages] == [
        ("system", "Be brief.\nUse tools.", ""),
        ("user", "Weather in Paris?", ""),
        ("assistant", "Checking.", ""),
        ("tool", "Error: down", "call_1"),
        ("user", "And Rome?", ""),
    ]
    [call] = chat.messages[2].tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_1", "get_weather", {"city": "Paris"})
    [tool] = chat.tools
    assert (tool.name, tool.description, json.loads(tool.parameters_json)) == ("get_weather", "Weather now", WEATHER)
    assert chat.tool_choice.mode == gateway_pb2.TOOL_CHOICE_MODE_REQUIRED and chat.parallel_tool_calls is False
    s = chat.sampling
    assert (s.max_tokens, list(s.stop), s.temperature, s.top_k, s.HasField("top_p")) == (8, ["END"], 0, 5, False)
    assert chat.user == "u-1" and chat.model == "tiny"


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        ({"type": "auto"}, gateway_pb2.TOOL_CHOICE_MODE_AUTO, ""),
        ({"type": "none"}, gateway_pb2.TOOL_CHOICE_MODE_NONE, ""),
        ({"type": "tool", "name": "get_weather"}, gateway_pb2.TOOL_CHOICE_MODE_UNSPECIFIED, "get_weather"),
    ],
)
def test_tool_choices(choice, mode, name) -> None:
    chat = chat_request(parse(ASK | {"tools": [TOOL], "tool_choice": choice}))

    assert (chat.tool_choice.mode, chat.tool_choice.function_name) == (mode, name)
    assert not chat.HasField("parallel_tool_calls")


def test_a_final_assistant_message_is_refused_not_closed() -> None:
    body = ASK | {"messages": [*ASK["messages"], {"role": "assistant", "content": "It is"}]}
    with pytest.raises(ParamError, match="messages.1: a final assistant message") as info:
        chat_request(parse(body))
    assert info.value.param == "messages.1"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"frequency_penalty": 1}, "frequency_penalty: unknown field"),
        ({"anthropic-beta": "x"}, "anthropic-beta: unknown field"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: not supported by kvmesh"),
        ({"output_config": {"effort": "low"}}, "output_config: not supported by kvmesh"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ({"tools": [TOOL | {"cache_control": {"type": "forever"}}]}, "tools.0.cache_control.type: Input should be"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'web_search_20250305' tools are not"),
        ({"tool_choice": {"type": "required"}}, "tool_choice.type must be one of auto, any, tool, none"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0: role must be user or assistant"),
    ],
)
def test_a_field_not_served_is_a_400_naming_it(extra, message) -> None:
    assert message in refusal(ASK | extra)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}],
            "messages.0.content.0: 'image' content blocks are not supported (served: text, tool_result)",
        ),
        ([{"type": "document", "source": {}}], "'document' content blocks are not supported"),
        ([{"type": "text", "text": "x", "colour": "red"}], "messages.0.content.0.colour: unknown field"),
        ([{"type": "tool_use", "id": "c", "name": "f", "input": {}}], "'tool_use' content blocks are not supported"),
        (
            [{"type": "tool_result", "tool_use_id": "c", "content": [{"type": "image", "source": {}}]}],
            "messages.0.content.0.content.0: 'image' content blocks are not supported (served: text)",
        ),
    ],
)
def test_a_block_not_served_is_a_400_naming_it(content, message) -> None:
    assert message in refusal(ASK | {"messages": [{"role": "user", "content": content}]})


def test_an_assistant_turn_may_not_carry_tool_results() -> None:
    result = {"type": "tool_result", "tool_use_id": "c", "content": "x"}
    body = ASK | {"messages": [{"role": "assistant", "content": [result]}, *ASK["messages"]]}
    assert "'tool_result' content blocks are not supported (served: text, tool_use)" in refusal(body)


def _chunk(text: str = "", tokens: int = 1, calls=(), final: int | None = None) -> gateway_pb2.ChatResponse:
    chunk = gateway_pb2.ChatResponse(text=text, token_ids=list(range(tokens)), tool_calls=list(calls))
    if final is not None:
        usage = accounting_pb2.Usage(prompt_tokens=40, cached_tokens=16)
        chunk.final.CopyFrom(gateway_pb2.StreamEnd(finish_reason=final, usage=usage))
    return chunk


def _renderer(stop_sequences=(), decoded: str = "") -> MessageRenderer:
    return MessageRenderer("msg_1", "tiny", stop_sequences, lambda ids: decoded)


def test_text_then_calls_render_as_blocks_and_events_that_add_up() -> None:
    call = gateway_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    renderer = _renderer()
    events = [renderer.start()]
    for chunk in [
        _chunk("On"),
        _chunk(" it."),
        _chunk(calls=[call]),
        _chunk(tokens=2, final=sampling_pb2.FINISH_REASON_TOOL_CALLS),
    ]:
        events += renderer.add(chunk)
    events += renderer.finish()
    message = renderer.message().model_dump()

    assert message["content"] == [
        {"type": "text", "text": "On it."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert (message["id"], message["stop_reason"], message["stop_sequence"]) == ("msg_1", "tool_use", None)
    assert message["usage"] == {"input_tokens": 24, "output_tokens": 5, "cache_read_input_tokens": 16}
    assert [(e.type, getattr(e, "index", None)) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    dumped = [e.model_dump() for e in events]
    assert dumped[0]["message"]["content"] == [] and dumped[0]["message"]["stop_reason"] is None
    assert dumped[5]["content_block"]["input"] == {}
    assert json.loads(dumped[6]["delta"]["partial_json"]) == {"city": "Paris"}
    assert dumped[8]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert dumped[8]["usage"] == message["usage"]


@pytest.mark.parametrize(
    ("finish", "stop_sequences", "decoded", "stop_reason", "stop_sequence"),
    [
        (sampling_pb2.FINISH_REASON_STOP, (), "Hi", "end_turn", None),
        (sampling_pb2.FINISH_REASON_STOP, ("END", "Hi"), "Hi", "stop_sequence", "Hi"),
        (sampling_pb2.FINISH_REASON_STOP, ("END",), "Hi", "end_turn", None),  # EOS: no stop in the tokens
        (sampling_pb2.FINISH_REASON_LENGTH, ("Hi",), "Hi", "max_tokens", None),
        (sampling_pb2.FINISH_REASON_REPETITION, (), "Hi", "max_tokens", None),
    ],
)
def test_stop_reasons(finish, stop_sequences, decoded, stop_reason, stop_sequence) -> None:
    renderer = _renderer(stop_sequences, decoded)
    renderer.add(_chunk(final=finish))
    end = renderer.finish()[0].delta

    assert (renderer.message().stop_reason, renderer.message().stop_sequence) == (stop_reason, stop_sequence)
    assert (end.stop_reason, end.stop_sequence) == (stop_reason, stop_sequence)


def test_the_stop_sequence_that_fired_is_the_earliest() -> None:
    assert fired_stop("a long, long END. STOP", ["STOP", "END", "ND"]) == "END"
    assert fired_stop("ab", ["b", "ab", "a"]) == "ab"  # the longest of those starting first
    assert fired_stop("no stop here", ["STOP"]) is None


def test_an_aborted_request_is_an_error_not_a_stop_reason() -> None:
    with pytest.raises(Unavailable, match="aborted in the mesh"):
        _renderer().add(_chunk(final=sampling_pb2.FINISH_REASON_ABORT))


@pytest.mark.parametrize(
    ("error", "status", "kind", "message"),
    [
        (ParamError("max_tokens: too big", "max_tokens"), 400, "invalid_request_error", "max_tokens: too big"),
        (Unauthenticated("invalid API key"), 401, "authentication_error", "invalid API key"),
        (NotFound("model 'x' not found"), 404, "not_found_error", "model 'x' not found"),
        (ResourceExhausted("too many"), 429, "rate_limit_error", "too many"),
        (Unavailable("no worker"), 503, "overloaded_error", "no worker"),
        (RuntimeError("secret detail"), 500, "api_error", "internal error (request_id=r-1)"),
    ],
)
def test_errors_in_anthropics_shape(error, status, kind, message) -> None:
    got_status, body = anthropic_error_body(error, "r-1")

    assert got_status == status
    assert body.model_dump() == {"type": "error", "error": {"type": kind, "message": message}}


def test_cache_control_breakpoints_are_served_by_the_prefix_cache_unchanged() -> None:
    ephemeral = {"type": "ephemeral"}
    marked = ASK | {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": ephemeral | {"ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": ephemeral}]}],
        "tools": [TOOL | {"cache_control": ephemeral}],
        "cache_control": ephemeral,
    }
    plain = ASK | {
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [TOOL],
    }
    assert chat_request(parse(marked)) == chat_request(parse(plain))
