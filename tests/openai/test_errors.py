"""Every error the OpenAI API answers, with its status and OpenAI's error body, against real processes."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.runtime import common_flags, parse_flags, serve
from kvmesh.runtime.ports import free_port
from services.gateway.main import FLAGS, build
from tests.e2e.mesh_helpers import metrics, poll
from tests.openai.conftest import API_KEY, MODEL, post_raw

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "hi"}]


def _error(info: pytest.ExceptionInfo) -> dict:
    return info.value.response.json()["error"]


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"temperature": 5}, "temperature", "temperature: Input should be less than or equal to 2"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty: Input should be less than or equal to 2"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "Input should be less than or equal to 100"),
        ({"tool_choice": "auto"}, "tool_choice", "no tools are declared"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "keyword 'uniqueItems' is not supported",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({"n": 0}, "n", "n: Input should be greater than or equal to 1"),
    ],
)
def test_bad_parameters_are_400_naming_them(client, kwargs, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, **kwargs)

    error = _error(info)
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and message in error["message"]


def test_a_prompt_over_the_context_is_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1 + i % 500 for i in range(599)])

    assert _error(info)["code"] == "context_length_exceeded"
    assert "prompt has 599 tokens; the model's context is 512" in _error(info)["message"]


def test_an_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI)

    assert _error(info) == {
        "message": f"model 'gpt-4o' is not served here; this gateway serves '{MODEL}'",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }


def test_a_wrong_or_missing_key_is_401_on_http_and_unauthenticated_on_grpc(guarded) -> None:
    with pytest.raises(openai.AuthenticationError) as wrong:
        guarded.client(api_key="sk-wrong").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    body = json.dumps({"model": MODEL, "messages": HI}).encode()
    with pytest.raises(urllib.error.HTTPError) as missing:  # no Authorization header at all
        urllib.request.urlopen(urllib.request.Request(guarded.url + "/v1/chat/completions", data=body), timeout=30)
    ok = guarded.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=2)

    assert wrong.value.status_code == 401 and _error(wrong)["code"] == "invalid_api_key"
    assert missing.value.code == 401 and "missing API key" in json.loads(missing.value.read())["error"]["message"]
    assert ok.usage.completion_tokens <= 2

    request = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    with grpc.insecure_channel(guarded.process.address("gateway-guarded")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            list(stub.Chat(request, metadata=(("authorization", "Bearer sk-wrong"),), timeout=30))
        served = list(stub.Chat(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60))

    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert served[-1].HasField("final")


def test_admission_control_sheds_load_with_429(mesh, guarded) -> None:
    # The guarded gateway's one slot must still be taken when the second request arrives, but this tiny model
    # streams 400 tokens in well under a second: a first request read up to its first chunk could be finished
    # before the second was sent (CI saw it once). With the prefill worker stopped, the first request is
    # admitted and then waits on its prefill for as long as the test needs; the gateway's admission answers
    # without any worker.
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 400, "stream": True}).encode()
    mesh.kill("prefill-0", signal.SIGSTOP)
    try:
        with post_raw(guarded.url, body, b"Authorization: Bearer %s\r\n" % API_KEY.encode()):
            inflight = poll(
                lambda: metrics(guarded.process, "gateway-guarded")["kvmesh_gateway_inflight_requests"],
                lambda n: n == 1,
                polls=500,
                interval_s=0.01,
            )
            assert inflight == 1  # admitted, and waiting on the stopped prefill
            with pytest.raises(openai.RateLimitError) as info:
                guarded.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    finally:
        mesh.kill("prefill-0", signal.SIGCONT)

    assert info.value.status_code == 429 and _error(info)["code"] == "rate_limit_exceeded"
    assert "limit of 1 requests in flight" in _error(info)["message"]


async def test_a_gateway_whose_router_is_gone_answers_503_at_once(openai_model) -> None:
    dead = f"127.0.0.1:{free_port()}"
    http_port = free_port()
    argv = [
        "--router-address",
        dead,
        "--model",
        str(openai_model),
        "--http-port",
        str(http_port),
        "--rpc-timeout-seconds",
        "5",
    ]
    args = parse_flags("kvmesh-gateway", [*common_flags(0, 0), *FLAGS], argv, environ={})
    async with serve("gateway", build, args, grace_seconds=1.0):
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=30
        ) as client:
            with pytest.raises(openai.InternalServerError) as info:
                await client.chat.completions.create(model=MODEL, messages=HI, stream=True)

    assert info.value.status_code == 503 and _error(info)["code"] == "service_unavailable"
    assert f"router ({dead})" in _error(info)["message"]
