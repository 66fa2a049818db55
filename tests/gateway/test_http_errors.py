"""Every way an HTTP request can fail, each with its status and OpenAI's error body; nothing left behind."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from services.gateway import http_app
from tests.gateway.conftest import CONTEXT
from tests.gateway.fakes import FakeMesh
from tests.gateway.helpers import PROMPT
from tests.gateway.test_http_api import http_gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 20}]}
COMPLETION = {"model": "tiny", "prompt": PROMPT}
JSON_SCHEMA = {"type": "json_schema"}


def _schema(schema: dict) -> dict:
    return JSON_SCHEMA | {"json_schema": {"name": "reply", "schema": schema}}


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name} | ({"parameters": parameters} if parameters else {})}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


async def _post(url: str, path: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        kwargs = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
        async with http.post(url + path, **kwargs) as r:
            return r.status, await r.json()


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", "{not json", None, "Invalid JSON"),
        ("/v1/completions", [1, 2], None, "Input should be an object"),
        ("/v1/completions", {"prompt": "x"}, "model", "model: Field required"),
        ("/v1/completions", COMPLETION | {"temperature": 3}, "temperature", "less than or equal to 2"),
        ("/v1/completions", COMPLETION | {"temperature": "1"}, "temperature", "valid number"),
        ("/v1/completions", COMPLETION | {"n": 0}, "n", "greater than or equal to 1"),
        ("/v1/completions", COMPLETION | {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("/v1/completions", COMPLETION | {"stop": ""}, "stop", "at least 1 character"),
        ("/v1/completions", COMPLETION | {"prompt": ""}, "prompt", "prompt: String should have at least 1 character"),
        (
            "/v1/completions",
            COMPLETION | {"prompt": [[1, 2], []]},
            "prompt.1",
            "prompt.1: List should have at least 1 item",
        ),
        # Of the prompt's alternatives, only the one the value came closest to is reported.
        (
            "/v1/completions",
            COMPLETION | {"prompt": [-1]},
            "prompt.0",
            "prompt.0: Input should be greater than or equal to 0",
        ),
        ("/v1/completions", COMPLETION | {"n": 1.5}, "n", "n: Input should be a valid integer"),
        (
            "/v1/completions",
            COMPLETION | {"prompt": [1, 100_000]},
            "prompt",
            "token id 100000 is outside the vocabulary",
        ),
        ("/v1/completions", COMPLETION | {"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ("/v1/completions", COMPLETION | {"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ("/v1/completions", COMPLETION | {"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ("/v1/completions", COMPLETION | {"logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
        (
            "/v1/completions",
            COMPLETION | {"logit_bias": {"100000": 1}},
            "logit_bias",
            "token id 100000 is outside the vocabulary",
        ),
        ("/v1/completions", COMPLETION | {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ("/v1/completions", COMPLETION | {"echo": True}, "echo", "not supported"),
        ("/v1/completions", COMPLETION | {"suffix": "x"}, "suffix", "not supported yet"),
        ("/v1/completions", COMPLETION | {"best_of": 3}, "best_of", "best_of must equal n (1)"),
        ("/v1/completions", COMPLETION | {"logprobs": 21}, "logprobs", "less than or equal to 20"),
        (
            "/v1/completions",
            COMPLETION | {"stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed with stream: true",
        ),
        ("/v1/completions", COMPLETION | {"n": 5}, "n", "asks for 5 generations"),
        ("/v1/chat/completions", CHAT | {"messages": []}, "messages", "at least 1 item"),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "bot", "content": "x"}]},
            "messages.0",
            "role must be one of system, developer, user, assistant, tool",
        ),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "tool", "content": "x"}]},
            "messages.0.tool_call_id",
            "Field required",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "only text content parts are supported, not 'image_url' parts",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": {"type": "xml"}},
            "response_format",
            "type must be one of text, json_object, json_schema",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": JSON_SCHEMA | {"json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
            "should match pattern",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": _schema({"type": "string", "format": "idn-email"})},
            "response_format",
            "structured output: json_schema: format 'idn-email' is not supported",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": _schema({"type": "object", "not": {}})},
            "response_format",
            "keyword 'not' is not supported (at /not)",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": _schema({"type": 7})},
            "response_format",
            "not a valid JSON Schema",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"response_format": {"type": "json_object"}, "tools": [_tool("f")]},
            "response_format",
            "cannot be combined with tools",
        ),
        ("/v1/chat/completions", CHAT | {"tools": [_tool("a b")]}, "tools.0.function.name", "should match pattern"),
        (
            "/v1/chat/completions",
            CHAT | {"tools": [_tool("f"), _tool("f")]},
            "tools.1.function.name",
            "tool name 'f' is declared twice",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"tools": [_tool("f", {"type": "array"})]},
            "tools.0.function.parameters",
            "tool 'f': parameters must be a JSON Schema of an object",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"tools": [_tool("f", {"type": "object", "if": {}})]},
            "tools.0.function.parameters",
            "tool 'f' parameters: json_schema: keyword 'if' is not supported",
        ),
        ("/v1/chat/completions", CHAT | {"tool_choice": "auto"}, "tool_choice", "no tools are declared"),
        (
            "/v1/chat/completions",
            CHAT | {"tool_choice": "sometimes"},
            "tool_choice",
            "Input should be 'none', 'auto' or 'required'",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"tools": [_tool("f"), _tool("g")], "tool_choice": _named("h")},
            "tool_choice",
            "names the function 'h', which is not declared (tools: f, g)",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "assistant", "tool_calls": [_call("[1]")]}]},
            "messages.0.tool_calls.0.function.arguments",
            "must be a JSON object",
        ),
        (
            "/v1/chat/completions",
            CHAT | {"messages": [{"role": "assistant", "tool_calls": [_call("{")]}]},
            "messages.0.tool_calls.0.function.arguments",
            "is not valid JSON",
        ),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("/v1/chat/completions", CHAT | {"modalities": ["audio"]}, "modalities.0", "Input should be 'text'"),
    ],
)
async def test_bad_requests_are_400_naming_the_parameter(model, path, body, param, message) -> None:
    mesh = FakeMesh()
    async with http_gateway(model, mesh, max_inflight=4) as served:
        status, error = await _post(served.url, path, body)

    assert status == 400
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
    assert message in error["error"]["message"]
    assert mesh.routes == []


async def test_neutral_values_of_fields_we_do_not_serve_are_accepted(model) -> None:
    harmless = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tools": None,
        "parallel_tool_calls": True,
        "modalities": ["text"],
        "store": False,
        "metadata": {},
    }
    async with http_gateway(model, FakeMesh()) as served:
        status, body = await _post(served.url, "/v1/chat/completions", CHAT | harmless | {"max_tokens": 4})

    assert status == 200 and body["choices"][0]["message"]["content"]


async def test_a_prompt_over_the_context_is_400_context_length_exceeded(model) -> None:
    async with http_gateway(model, FakeMesh()) as served:
        client = served.client()
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model="tiny", prompt=list(range(CONTEXT)))
        with pytest.raises(openai.BadRequestError) as no_room:
            await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=CONTEXT)

    for info in (too_long, no_room):
        assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert f"the model's context is {CONTEXT}" in too_long.value.message


async def test_an_unknown_model_is_404_model_not_found(model) -> None:
    async with http_gateway(model, FakeMesh()) as served:
        with pytest.raises(openai.NotFoundError) as info:
            await served.client().chat.completions.create(model="gpt-9", messages=CHAT["messages"])

    assert info.value.code == "model_not_found"
    assert info.value.body == {
        "message": "model 'gpt-9' is not served here; this gateway serves 'tiny'",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_no_router_is_503_before_any_byte_of_the_stream(model, stream) -> None:
    mesh = FakeMesh()
    mesh.router_down = True
    async with http_gateway(model, mesh) as served:
        with pytest.raises(openai.InternalServerError) as info:
            await served.client().completions.create(model="tiny", prompt=PROMPT, stream=stream)

    assert info.value.status_code == 503 and info.value.code == "service_unavailable"
    assert "router (r:1) unreachable" in info.value.message


async def test_admission_control_sheds_load_with_429(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 1
    async with http_gateway(model, mesh, max_inflight=2) as served:
        client = served.client()
        held = [asyncio.create_task(client.completions.create(model="tiny", prompt=PROMPT))]
        await _until(lambda: served.gateway.inflight == 1)
        # n=2 needs two slots and one is taken: refused as a whole, its admitted half cancelled.
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="tiny", prompt=PROMPT, n=2)
        await _until(lambda: served.gateway.inflight == 1)
        held.append(asyncio.create_task(client.completions.create(model="tiny", prompt=PROMPT)))
        await _until(lambda: served.gateway.inflight == 2)
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(model="tiny", prompt=PROMPT)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await _until(lambda: served.gateway.inflight == 0 and mesh.open_streams == 0)
        await served.gateway.wait_idle()

    assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
    assert "limit of 2 requests in flight" in info.value.message
    assert mesh.leases == set()


async def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(model) -> None:
    mesh = FakeMesh(decode=("d0",))
    mesh.fail_decode_at["d0"] = 2
    async with http_gateway(model, mesh) as served:
        stream = await served.client().chat.completions.create(model="tiny", messages=CHAT["messages"], stream=True)
        got = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)

    assert got == ["<7>", "<11>"]
    assert "after 2 tokens were streamed; no other worker to resume on" in info.value.message
    assert served.gateway.inflight == 0 and mesh.leases == set()


async def test_a_body_over_the_limit_is_413(model, monkeypatch) -> None:
    monkeypatch.setattr(http_app, "MAX_BODY_BYTES", 1000)
    async with http_gateway(model, FakeMesh()) as served:
        status, body = await _post(served.url, "/v1/completions", COMPLETION | {"prompt": "x" * 2000})

    assert status == 413 and body["error"]["type"] == "invalid_request_error"


async def test_unknown_paths_and_methods_get_openai_error_bodies(model) -> None:
    async with http_gateway(model, FakeMesh()) as served, aiohttp.ClientSession() as http:
        async with http.get(served.url + "/v1/nothing") as r:
            missing = (r.status, (await r.json())["error"]["code"])
        async with http.delete(served.url + "/v1/completions") as r:
            wrong = (r.status, r.headers["Allow"], (await r.json())["error"]["type"])

    assert missing == (404, "not_found")
    assert wrong == (405, "POST", "invalid_request_error")


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_client_hanging_up_mid_stream_cancels_the_request_in_the_mesh(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 2
    async with http_gateway(model, mesh) as served:
        async with aiohttp.ClientSession() as http:
            response = await http.post(served.url + "/v1/completions", json=COMPLETION | {"stream": True, "n": 2})
            assert (await response.content.readline()).startswith(b"data: ")
            await _until(lambda: len(mesh.decodes) == 2 and mesh.held.is_set())
            assert served.gateway.inflight == 2
            response.close()  # drops the connection mid-stream
        await _until(lambda: served.gateway.inflight == 0 and mesh.open_streams == 0)
        await served.gateway.wait_idle()

    assert sorted(mesh.cancelled) == [("decode", "d0"), ("decode", "d0")]
    assert mesh.leases == set()


async def test_a_client_hanging_up_before_a_whole_response_cancels_the_request(model) -> None:
    mesh = FakeMesh()
    mesh.hold_decode_at["d0"] = 2
    async with http_gateway(model, mesh) as served:
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.post(served.url + "/v1/completions", json=COMPLETION))
            await asyncio.wait_for(mesh.held.wait(), 10)
            request.cancel()  # closes the connection while the server is still generating
            await asyncio.gather(request, return_exceptions=True)
        await _until(lambda: served.gateway.inflight == 0 and mesh.open_streams == 0)
        await served.gateway.wait_idle()

    assert mesh.cancelled == [("decode", "d0")] and mesh.leases == set()


async def test_a_client_hanging_up_during_prefill_cancels_the_prefill(model) -> None:
    mesh = FakeMesh()
    mesh.hold_prefill = True
    async with http_gateway(model, mesh) as served:
        async with aiohttp.ClientSession() as http:
            response = asyncio.create_task(http.post(served.url + "/v1/completions", json=COMPLETION))
            await asyncio.wait_for(mesh.held.wait(), 10)
            response.cancel()
            await asyncio.gather(response, return_exceptions=True)
        await _until(lambda: served.gateway.inflight == 0)

    assert mesh.cancelled == [("prefill", "p0")] and mesh.decodes == []
