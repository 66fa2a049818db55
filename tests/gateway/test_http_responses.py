"""POST /v1/responses and GET/DELETE /v1/responses/{id} through the HTTP API (official client, fake mesh)."""

from __future__ import annotations

import json

import openai
import pytest

from services.gateway.auth import ApiKeys
from tests.gateway.fakes import FakeMesh
from tests.gateway.test_http_api import TEXT, http_gateway
from tests.gateway.test_http_tools import CALLS_REPLY, roomy, scripted  # noqa: F401 - roomy is a fixture

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def prompt_of(model, mesh: FakeMesh, i: int) -> str:
    return model.tokenizer.decode(list(mesh.routes[i].tokens.token_ids), skip_special_tokens=False)


async def test_a_response_and_its_stream_say_the_same(model) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh) as served:
        client = served.client()
        whole = await client.responses.create(model="tiny", input="hi", max_output_tokens=4, metadata={"k": "v"})
        events = [e async for e in await client.responses.create(model="tiny", input="hi", stream=True)]

    assert whole.id.startswith("resp_") and whole.object == "response" and whole.output_text == TEXT
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.output_tokens, whole.usage.input_tokens_details.cached_tokens) == (4, 16)
    assert whole.metadata == {"k": "v"} and whole.store is True
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    assert events[-1].response.output_text == TEXT


async def test_calls_are_function_call_items_and_their_outputs_go_back_as_tool_messages(roomy) -> None:  # noqa: F811
    mesh = scripted(CALLS_REPLY)
    async with http_gateway(roomy, mesh) as served:
        client = served.client()
        first = await client.responses.create(model="tiny", input="Weather in Paris and Rome?", tools=TOOLS)
        calls = [item for item in first.output if item.type == "function_call"]
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "20 C"} for c in calls]
        await client.responses.create(model="tiny", input=[*first.output, *outputs], tools=TOOLS, store=False)

    assert [i.type for i in first.output] == ["message", "function_call", "function_call"]
    assert first.output_text == "On it." and first.status == "completed"
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    follow_up = prompt_of(roomy, mesh, 1)
    assert follow_up.count("<tool_response>\n20 C\n</tool_response>") == 2 and '"city": "Rome"' in follow_up


async def test_a_follow_up_continues_the_stored_conversation_without_its_instructions(model) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh) as served:
        client = served.client()
        first = await client.responses.create(model="tiny", input="Hello there", instructions="Be terse.")
        second = await client.responses.create(model="tiny", input="And then?", previous_response_id=first.id)
        fetched = await client.responses.retrieve(first.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)

    assert second.previous_response_id == first.id and second.instructions is None
    prompt = prompt_of(model, mesh, 1)
    assert "Hello there" in prompt and first.output_text in prompt and "And then?" in prompt
    assert "Be terse." not in prompt and "Be terse." in prompt_of(model, mesh, 0)
    assert fetched.id == first.id and fetched.output_text == first.output_text


async def test_an_unknown_or_another_tenants_previous_response_is_a_404_naming_it(model) -> None:
    keys = ApiKeys(["sk-a team-a", "sk-b team-b"])
    async with http_gateway(model, FakeMesh(), keys) as served:
        first = await served.client("sk-a").responses.create(model="tiny", input="hi")
        for api_key, response_id in (("sk-a", "resp_unknown"), ("sk-b", first.id)):
            with pytest.raises(openai.NotFoundError) as e:
                await served.client(api_key).responses.create(
                    model="tiny", input="hi", previous_response_id=response_id
                )
            assert e.value.body["param"] == "previous_response_id" and response_id in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            await served.client("sk-b").responses.retrieve(first.id)


async def test_an_unknown_field_is_a_400_naming_it(model) -> None:
    async with http_gateway(model, FakeMesh()) as served:
        with pytest.raises(openai.BadRequestError) as e:
            await served.client().responses.create(model="tiny", input="hi", extra_body={"stop_sequences": ["x"]})
    assert e.value.body["param"] == "stop_sequences"


async def test_the_cores_checks_name_the_responses_fields(roomy) -> None:  # noqa: F811
    async with http_gateway(roomy, FakeMesh()) as served:
        with pytest.raises(openai.BadRequestError) as e:
            await served.client().responses.create(
                model="tiny", input="hi", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"}
            )
    assert e.value.body["param"] == "tool_choice" and "get_time" in e.value.body["message"]


async def test_a_failure_after_the_first_token_is_the_streams_last_event_an_error(model) -> None:
    mesh = FakeMesh(decode=("d0",))
    mesh.fail_decode_at["d0"] = 2
    async with http_gateway(model, mesh) as served:
        stream = await served.client().responses.create(model="tiny", input="hi", stream=True)
        events = [e async for e in stream]
        with pytest.raises(openai.NotFoundError):  # a failed response is not stored
            await served.client().responses.retrieve(events[0].response.id)

    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["<7>", "<11>"]
    last = events[-1]
    assert last.type == "error" and last.sequence_number == len(events) - 1
    assert last.code == "service_unavailable" and "no other worker to resume on" in last.message
    assert served.gateway.inflight == 0 and mesh.leases == set()
