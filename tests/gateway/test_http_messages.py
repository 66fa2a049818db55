"""POST /v1/messages on the gateway core over the fake mesh, with the official ``anthropic`` client (aiohttp
where the raw bytes matter): messages, streamed events, tool calls, x-api-key auth, errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import pytest

from services.gateway.auth import ApiKeys
from services.gateway.model import ServedModel
from tests.gateway.fakes import FakeMesh
from tests.gateway.test_http_api import TEXT, Served, http_gateway
from tests.gateway.test_http_tools import CALLS_REPLY, WEATHER, roomy, scripted  # noqa: F401 - roomy: a fixture

ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]


@asynccontextmanager
async def client(served: Served, api_key: str = "unused") -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=served.url, api_key=api_key, max_retries=0, timeout=30) as c:
        yield c


async def post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/messages", json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_a_message_with_usage(model: ServedModel) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh) as served, client(served) as c:
        message = await c.messages.create(model="tiny", max_tokens=4, system="Be brief.", messages=ASK)

    assert message.id.startswith("msg_") and (message.type, message.role, message.model) == (
        "message",
        "assistant",
        "tiny",
    )
    assert [(b.type, b.text) for b in message.content] == [("text", TEXT)]
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)  # the fake ends on LENGTH
    [route] = mesh.routes
    prompt = len(route.tokens.token_ids)
    # Cached: what the fake prefill worker reused.
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (prompt - 16, 16)
    assert message.usage.output_tokens == 4 and route.max_new_tokens == 4


async def test_a_streamed_message_adds_up_to_the_message(model: ServedModel) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": ASK}
    async with http_gateway(model, FakeMesh()) as served, client(served) as c:
        whole = await c.messages.create(**body)
        async with c.messages.stream(**body) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        async with aiohttp.ClientSession() as http:
            async with http.post(served.url + "/v1/messages", json=body | {"stream": True}) as r:
                raw = (await r.read()).decode()

    assert texts == ["<7>", "<11>", "<12>", "<13>"] and [b.text for b in whole.content] == [TEXT]
    assert [b.text for b in final.content] == [TEXT] and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage == whole.usage
    events = [block.split("\n")[0] for block in raw.strip().split("\n\n")]
    assert events == [
        "event: message_start",
        "event: content_block_start",
        *["event: content_block_delta"] * 4,
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]


async def test_tool_use_blocks_with_input_objects_whole_and_streamed(roomy: ServedModel) -> None:  # noqa: F811
    mesh = scripted(CALLS_REPLY)
    async with http_gateway(roomy, mesh) as served, client(served) as c:
        message = await c.messages.create(
            model="tiny", max_tokens=64, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
        )
        async with c.messages.stream(model="tiny", max_tokens=64, messages=ASK, tools=TOOLS) as stream:
            final = await stream.get_final_message()

    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "On it."
    assert [b.input for b in message.content[1:]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(b.name == "get_weather" and b.id for b in message.content[1:])
    assert message.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in message.content
    ]


async def test_x_api_key_is_the_same_key_as_bearer(model: ServedModel) -> None:
    mesh = FakeMesh()
    keys = ApiKeys(["k-alice alice"])
    body = {"model": "tiny", "max_tokens": 4, "messages": ASK}
    async with http_gateway(model, mesh, keys=keys) as served:
        async with client(served, api_key="k-alice") as c:
            await c.messages.create(**body)
        async with client(served, api_key="k-eve") as c:
            with pytest.raises(anthropic.AuthenticationError) as wrong:
                await c.messages.create(**body)
        bearer = await post(served.url, body, {"Authorization": "Bearer k-alice"})
        missing = await post(served.url, body)
        async with aiohttp.ClientSession(headers={"x-api-key": "k-alice"}) as http:
            async with http.get(served.url + "/v1/models") as r:
                models = r.status

    assert wrong.value.status_code == 401
    assert wrong.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    assert bearer[0] == 200 and models == 200
    assert missing[0] == 401 and missing[1]["error"]["type"] == "authentication_error"
    assert [r.cache_salt for r in mesh.routes] == [b"5:alice", b"5:alice"]


@pytest.mark.parametrize(
    ("change", "status", "kind", "message"),
    [
        ({"foo": 1}, 400, "invalid_request_error", "foo: unknown field"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "messages.0.content.0: 'image' content blocks are not supported (served: text, tool_result)",
        ),
        ({"thinking": {"type": "enabled"}}, 400, "invalid_request_error", "thinking: not supported by kvmesh"),
        ({"model": "claude-9"}, 404, "not_found_error", "claude-9"),
    ],
)
async def test_errors_are_in_anthropics_shape(model: ServedModel, change, status, kind, message) -> None:
    async with http_gateway(model, FakeMesh()) as served:
        got_status, body = await post(served.url, {"model": "tiny", "max_tokens": 4, "messages": ASK} | change)

    assert got_status == status and body["type"] == "error" and body["error"]["type"] == kind
    assert message in body["error"]["message"] and set(body["error"]) == {"type", "message"}


async def test_lenient_fields_drops_unknown_fields_of_messages_too(model: ServedModel) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi", "x-junk": 1}], "foo": 1}
    async with http_gateway(model, FakeMesh(), lenient_fields=True) as served:
        status, message = await post(served.url, body)
        refused, error = await post(served.url, body | {"thinking": {"type": "enabled"}})

    assert status == 200 and message["type"] == "message"
    assert refused == 400 and "thinking" in error["error"]["message"]  # known but not served: still a 400


async def test_a_draining_gateway_refuses_messages_as_overloaded(model: ServedModel) -> None:
    async with http_gateway(model, FakeMesh()) as served:
        served.api.draining = True
        status, body = await post(served.url, {"model": "tiny", "max_tokens": 4, "messages": ASK})

    assert status == 503 and body["error"]["type"] == "overloaded_error"


async def test_a_failure_after_the_first_token_is_an_error_event(model: ServedModel) -> None:
    mesh = FakeMesh(decode=("d0",))
    mesh.fail_decode_at["d0"] = 2
    async with http_gateway(model, mesh) as served, client(served) as c:
        got = []
        with pytest.raises(anthropic.APIStatusError) as info:
            async with c.messages.stream(model="tiny", max_tokens=4, messages=ASK) as stream:
                async for text in stream.text_stream:
                    got.append(text)

    assert got == ["<7>", "<11>"]
    assert "no other worker to resume on" in str(info.value.body)
    assert served.gateway.inflight == 0 and mesh.leases == set()
