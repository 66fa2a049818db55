"""The Responses API's pieces without a server: the body's validation, the translation to a ChatRequest,
the rendering (whole and as stream events) and the response stores."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from kvmesh.api.common.v1 import accounting_pb2, sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import Unavailable
from kvmesh.structured.spec import GrammarSpec
from services.gateway.openai_errors import ParamError
from services.gateway.openai_render import TokenTexts
from services.gateway.responses_render import ResponseRenderer
from services.gateway.responses_requests import Item, ResponseRequest
from services.gateway.responses_store import (
    LocalResponseStore,
    RedisResponseStore,
    ResponseNotFound,
    StoredResponse,
)
from services.gateway.responses_translate import chat_request, responses_param

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def parsed(**body) -> ResponseRequest:
    return ResponseRequest.model_validate_json(json.dumps({"model": "tiny", **body}))


def refusal(**body) -> ParamError:
    with pytest.raises(ValidationError) as e:
        parsed(**body)
    return ParamError.from_validation(e.value)


# -- the body --------------------------------------------------------------------


def test_an_unknown_field_is_refused_by_name() -> None:
    error = refusal(input="hi", stop_sequences=["x"])
    assert error.param == "stop_sequences" and "unknown field" in error.message


def test_an_unknown_field_inside_an_item_is_refused_by_name() -> None:
    assert refusal(input=[{"role": "user", "content": "hi", "name": "bob"}]).param == "input.0.name"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"truncation": "auto"}, "truncation", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools.0", "'web_search' tools are not supported"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' tool choices are not supported"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "'reasoning' items are not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
            "'input_image' content parts are not supported",
        ),
        ({"text": {"verbosity": "high"}}, "text.verbosity", "not supported"),
    ],
)
def test_what_the_responses_api_defines_but_kvmesh_does_not_serve_is_refused_by_name(body, param, says) -> None:
    error = refusal(**{"input": "hi", **body})
    assert error.param == param and says in error.message


def test_harmless_values_of_unserved_fields_are_accepted() -> None:
    parsed(input="hi", background=False, include=[], truncation="disabled", service_tier="auto", reasoning=None)


# -- translation -------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "On it.", "annotations": []}],
    },
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"P"}'},
    {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"R"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "20 C"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25 C"}]},
]


def test_a_string_input_is_a_user_message_after_the_instructions() -> None:
    req = parsed(input="hi", instructions="Be brief.", max_output_tokens=8, temperature=0, top_p=0.5, user="u")
    chat = chat_request(req, req.input)

    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "hi")]
    s = chat.sampling
    assert (s.max_tokens, s.temperature, s.top_p, chat.user, chat.model) == (8, 0, 0.5, "u", "tiny")
    assert not chat.sampling.HasField("structured_output") and not chat.tools


def test_calls_belong_to_the_assistant_message_before_them_and_outputs_are_tool_messages() -> None:
    req = parsed(input=CONVERSATION)
    messages = chat_request(req, req.input).messages

    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assistant = messages[1]
    assert assistant.content == "On it."
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city":"P"}'),
        ("call_2", "get_weather", '{"city":"R"}'),
    ]
    assert [(m.tool_call_id, m.content) for m in messages[2:]] == [("call_1", "20 C"), ("call_2", "25 C")]


def test_a_call_without_a_message_before_it_is_an_assistant_message_of_its_own() -> None:
    req = parsed(input=[CONVERSATION[0], *CONVERSATION[2:3]])
    [_, assistant] = chat_request(req, req.input).messages
    assert assistant.role == "assistant" and assistant.content == "" and len(assistant.tool_calls) == 1


def test_tools_and_tool_choice_map_onto_the_chat_request() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    req = parsed(input="hi", tools=tools, tool_choice={"type": "function", "name": "get_weather"})
    chat = chat_request(req, req.input)

    [tool] = chat.tools
    assert (tool.name, json.loads(tool.parameters_json)) == ("get_weather", WEATHER)
    assert chat.tool_choice.function_name == "get_weather"
    req = parsed(input="hi", tools=tools, tool_choice="required", parallel_tool_calls=False)
    chat = chat_request(req, req.input)
    assert chat.tool_choice.mode == gateway_pb2.TOOL_CHOICE_MODE_REQUIRED and chat.parallel_tool_calls is False


@pytest.mark.parametrize(
    ("text_format", "schema"),
    [({"type": "json_object"}, {"type": "object"}), ({"type": "json_schema", "name": "w", "schema": WEATHER}, WEATHER)],
)
def test_a_json_format_is_the_requests_json_schema(text_format, schema) -> None:
    req = parsed(input="hi", text={"format": text_format})
    chat = chat_request(req, req.input)
    assert GrammarSpec.from_pb(chat.sampling.structured_output) == GrammarSpec.json_schema(schema)


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("sampling.structured_output", "text.format"),
        ("sampling.max_tokens", "max_output_tokens"),
        ("sampling.temperature", "temperature"),
        ("tools[1].parameters_json", "tools.1.parameters"),
        ("tool_choice.function_name", "tool_choice"),
        ("messages[3].tool_calls[0].arguments", "input"),
    ],
)
def test_the_cores_field_names_are_spelled_as_the_request_spells_them(field, param) -> None:
    assert responses_param(field) == param


# -- rendering -----------------------------------------------------------------------


def chunk(text: str = "", tokens: int = 1, calls=(), finish: int | None = None) -> gateway_pb2.ChatResponse:
    c = gateway_pb2.ChatResponse(text=text, token_ids=list(range(tokens)))
    for i, (name, arguments) in enumerate(calls):
        c.tool_calls.add(id=f"call_{name}_{i}", name=name, arguments=arguments)
    if finish is not None:
        c.final.finish_reason = finish
        c.final.usage.CopyFrom(accounting_pb2.Usage(prompt_tokens=40, completion_tokens=tokens, cached_tokens=32))
    return c


class _Tokenizer:
    def decode(self, ids, skip_special_tokens: bool) -> str:
        return "".join(f"<{i}>" for i in ids)


def renderer(**body) -> ResponseRenderer:
    return ResponseRenderer("resp_1", 1700000000, "tiny", parsed(**{"input": "hi", **body}), TokenTexts(_Tokenizer()))


def render(r: ResponseRenderer, chunks: list[gateway_pb2.ChatResponse]) -> list:
    events = r.start()
    for c in chunks:
        events += r.add(c)
    return [*events, r.end()]


STOP = sampling_pb2.FINISH_REASON_STOP
LENGTH = sampling_pb2.FINISH_REASON_LENGTH
CALLS = sampling_pb2.FINISH_REASON_TOOL_CALLS


def test_text_streams_as_one_message_item_and_the_last_event_carries_the_whole_response() -> None:
    r = renderer(metadata={"k": "v"})
    events = render(r, [chunk("Hel"), chunk(""), chunk("lo", finish=STOP)])

    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.content == [] and events[2].item.status == "in_progress"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[6].text == "Hello" and events[8].item.status == "completed"
    whole = events[-1].response
    assert whole == r.response()
    [message] = whole.output
    assert message.content[0].text == "Hello" and message.id == events[2].item.id
    assert (whole.status, whole.incomplete_details, whole.metadata) == ("completed", None, {"k": "v"})
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (40, 3, 43)
    assert usage.input_tokens_details.cached_tokens == 32


def test_a_reply_cut_at_max_output_tokens_is_incomplete() -> None:
    r = renderer(max_output_tokens=2)
    events = render(r, [chunk("a"), chunk("b", finish=LENGTH)])

    assert events[-1].type == "response.incomplete"
    whole = r.response()
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.max_output_tokens == 2


def test_calls_close_the_message_and_stream_as_function_call_items() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = renderer(tools=tools)
    calls = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    events = render(r, [chunk("On it."), chunk("", calls=calls, finish=CALLS)])

    assert [e.type for e in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *[
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        * 2,
        "response.completed",
    ]
    whole = r.response()
    assert [i.type for i in whole.output] == ["message", "function_call", "function_call"]
    assert [(i.call_id, i.name, i.arguments) for i in whole.output[1:]] == [
        ("call_get_weather_0", "get_weather", '{"city": "Paris"}'),
        ("call_get_weather_1", "get_weather", '{"city": "Rome"}'),
    ]
    added = [e for e in events if e.type == "response.output_item.added"][1]
    assert (added.output_index, added.item.arguments, added.item.status) == (1, "", "in_progress")
    assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == [a for _, a in calls]
    assert whole.tool_choice == "auto" and whole.tools[0].name == "get_weather"


def test_an_empty_reply_is_one_empty_message() -> None:
    r = renderer()
    render(r, [chunk("", finish=STOP)])
    [message] = r.response().output
    assert message.type == "message" and message.content[0].text == ""


def test_output_items_are_valid_input_items() -> None:
    r = renderer()
    render(r, [chunk("x"), chunk("", calls=[("f", "{}")], finish=CALLS)])
    output = [item.model_dump() for item in r.response().output]
    TypeAdapter(list[Item]).validate_json(json.dumps(output))
    parsed(input=output)


def test_an_error_event_names_the_problem_and_comes_last_in_sequence() -> None:
    r = renderer()
    events = r.start()
    error = r.error(Unavailable("the decode worker went away"), "rid-1")
    assert (error.type, error.sequence_number, error.message) == ("error", len(events), "the decode worker went away")
    assert error.code == "service_unavailable"


# -- stores ------------------------------------------------------------------------


def stored(response_id: str = "resp_1") -> StoredResponse:
    r = ResponseRenderer(response_id, 1, "tiny", parsed(input="hi"), TokenTexts(_Tokenizer()))
    r.add(chunk("x", finish=STOP))
    req = parsed(input="hi")
    return StoredResponse(response=r.response(), conversation=req.input)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_local_store_keeps_each_tenants_records_apart() -> None:
    store = LocalResponseStore(ttl_s=60)
    record = stored()
    await store.put("team-a", record)

    assert await store.get("team-a", "resp_1") == record
    with pytest.raises(ResponseNotFound) as e:
        await store.get("team-b", "resp_1", "previous_response_id")
    assert e.value.http_status == 404 and e.value.param == "previous_response_id" and "resp_1" in e.value.message
    with pytest.raises(ResponseNotFound):
        await store.delete("team-b", "resp_1")
    await store.delete("team-a", "resp_1")
    with pytest.raises(ResponseNotFound):
        await store.get("team-a", "resp_1")


async def test_the_local_store_forgets_records_past_their_ttl_and_beyond_its_bound() -> None:
    clock = Clock()
    store = LocalResponseStore(ttl_s=60, max_records=2, clock=clock)
    await store.put("t", stored("resp_1"))
    clock.now += 59
    assert (await store.get("t", "resp_1")).response.id == "resp_1"
    clock.now += 1
    with pytest.raises(ResponseNotFound):
        await store.get("t", "resp_1")

    for i in range(2, 5):
        await store.put("t", stored(f"resp_{i}"))
    assert len(store) == 2
    with pytest.raises(ResponseNotFound):
        await store.get("t", "resp_2")
    assert (await store.get("t", "resp_4")).response.id == "resp_4"


async def test_the_redis_store_keeps_records_per_tenant_with_a_ttl(redis_server) -> None:
    store = RedisResponseStore.connect(redis_server.url, ttl_s=60)
    try:
        record = stored()
        await store.put("team-a", record)
        assert await store.get("team-a", "resp_1") == record
        with pytest.raises(ResponseNotFound):
            await store.get("team-b", "resp_1")
        [key] = await store._client.keys("kvmesh:responses:*")  # noqa: SLF001 - the key's expiry
        assert b"team-a" not in key and 0 < await store._client.pttl(key) <= 60_000  # noqa: SLF001
        await store.delete("team-a", "resp_1")
        with pytest.raises(ResponseNotFound):
            await store.get("team-a", "resp_1")
    finally:
        await store.close()


async def test_the_redis_store_down_is_unavailable(redis_server) -> None:
    store = RedisResponseStore.connect(redis_server.url, ttl_s=60, timeout_s=0.5)
    redis_server.stop()
    try:
        with pytest.raises(Unavailable, match="response store"):
            await store.get("team-a", "resp_1")
    finally:
        await store.close()
