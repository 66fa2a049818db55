"""The OpenAI HTTP API on the gateway core over the fake mesh: requests, streaming, parameters, fan-out.

The server is the real one (``HttpServer`` on a free port, handler
cancellation on); the client is the official ``openai`` package, or aiohttp
where the raw bytes matter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.api.common.v1 import sampling_pb2
from services.gateway.auth import ApiKeys
from services.gateway.core import Gateway
from services.gateway.http_app import HttpApi
from services.gateway.http_server import HttpServer
from services.gateway.metrics import GatewayMetrics, HttpMetrics
from services.gateway.model import ServedModel
from tests.gateway.conftest import CONTEXT
from tests.gateway.fakes import FakeMesh
from tests.gateway.helpers import PROMPT, make_gateway, sample

TEXT = "<7><11><12><13>"  # what the fake mesh generates: the first token, then DECODE_TOKENS


@dataclass
class Served:
    url: str
    gateway: Gateway
    api: HttpApi
    registry: CollectorRegistry
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)  # closed with the server

    def client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        self.clients.append(openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30))
        return self.clients[-1]


@asynccontextmanager
async def http_gateway(
    model: ServedModel, mesh: FakeMesh, keys: ApiKeys | None = None, lenient_fields: bool = False, **gateway_kwargs
) -> AsyncIterator[Served]:
    """The HTTP API on a gateway core over ``mesh``, on a free port."""
    gateway = make_gateway(model, mesh, **gateway_kwargs)
    registry = CollectorRegistry()
    api = HttpApi(gateway, keys or ApiKeys(), registry, HttpMetrics(registry), lenient_fields=lenient_fields)
    server = HttpServer(api, "127.0.0.1", 0, grace_seconds=1.0)
    await server.start()
    served = Served(f"http://127.0.0.1:{server.port}", gateway, api, registry)
    try:
        yield served
    finally:
        for client in served.clients:
            await client.close()
        await server.stop()
        await gateway.wait_idle()


@pytest.fixture
def mesh() -> FakeMesh:
    return FakeMesh()


async def test_a_completion_of_token_ids_with_usage(model, mesh) -> None:
    async with http_gateway(model, mesh) as served:
        done = await served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)

    assert done.object == "text_completion" and done.model == "tiny" and done.id.startswith("cmpl-")
    [choice] = done.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, TEXT, "length", None)
    usage = done.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(PROMPT), 4, len(PROMPT) + 4)
    assert usage.prompt_tokens_details.cached_tokens == 16  # what the fake prefill worker reused
    [route] = mesh.routes
    assert list(route.tokens.token_ids) == PROMPT and route.max_new_tokens == 4


async def test_completions_default_to_16_tokens_and_chat_to_the_context(model, mesh) -> None:
    async with http_gateway(model, mesh) as served:
        await served.client().completions.create(model="tiny", prompt=PROMPT)
        await served.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])

    chat_room = model.max_model_len - len(mesh.routes[1].tokens.token_ids)  # resolved by the gateway
    assert [r.max_new_tokens for r in mesh.routes] == [16, chat_room]


async def test_each_prompt_gets_n_choices_with_seeds_derived_from_the_seed(model, mesh) -> None:
    prompts = [PROMPT, PROMPT[:20]]
    async with http_gateway(model, mesh) as served:
        done = await served.client().completions.create(model="tiny", prompt=prompts, n=2, seed=7, max_tokens=4)

    assert [c.index for c in done.choices] == [0, 1, 2, 3] and {c.text for c in done.choices} == {TEXT}
    routed = sorted((r.request_id, list(r.tokens.token_ids)) for r in mesh.routes)
    assert [tokens for _, tokens in routed] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert len({rid for rid, _ in routed}) == 4  # each choice is its own request in the mesh
    seeds = sorted((len(p.token_ids), p.sampling.seed) for _, p in mesh.prefills)
    assert seeds == [(20, 7), (20, 8), (40, 7), (40, 8)]
    # Each prompt counts once, however many choices it had.
    assert done.usage.prompt_tokens == 60 and done.usage.completion_tokens == 16


async def test_a_negative_seed_maps_into_the_meshs_unsigned_seeds(model, mesh) -> None:
    async with http_gateway(model, mesh) as served:
        await served.client().completions.create(model="tiny", prompt=PROMPT, seed=-1, max_tokens=4)

    assert mesh.prefills[0][1].sampling.seed == 2**64 - 1


async def test_chat_parameters_reach_the_mesh(model, mesh) -> None:
    async with http_gateway(model, mesh) as served:
        await served.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi " * 20}],
            temperature=0.5,
            top_p=0.9,
            stop=["x", "yz"],
            seed=3,
            max_tokens=100,
            max_completion_tokens=5,  # wins over max_tokens
            logprobs=True,
            top_logprobs=2,
            user="alice",
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logit_bias={"7": -100, "12": 2.5},
            extra_body={
                "top_k": 8,
                "min_p": 0.1,
                "ignore_eos": True,
                "cache_salt": "s1",
                "repetition_penalty": 1.2,
                # vLLM's names.
                "stop_token_ids": [3, 9],
                "min_tokens": 2,
                "include_stop_str_in_output": True,
                "skip_special_tokens": False,
                "spaces_between_special_tokens": True,
                "priority": 0,
                "guided_regex": "[ab]+",
            },
        )

    [(_, prefill)] = mesh.prefills
    s = prefill.sampling
    assert (s.temperature, round(s.top_p, 6), list(s.stop), s.seed, s.max_tokens) == (0.5, 0.9, ["x", "yz"], 3, 5)
    assert (s.logprobs, s.top_logprobs, s.top_k, round(s.min_p, 6), s.ignore_eos) == (True, 2, 8, 0.1, True)
    assert (s.presence_penalty, s.frequency_penalty, round(s.repetition_penalty, 6)) == (0.5, -0.25, 1.2)
    assert dict(s.logit_bias) == {7: -100.0, 12: 2.5}
    assert prefill.cache_salt == b"s1"
    assert (list(s.stop_token_ids), s.min_tokens, s.include_stop_str_in_output) == ([3, 9], 2, True)
    assert s.HasField("skip_special_tokens") and not s.skip_special_tokens
    assert s.structured_output.regex == "[ab]+"


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"some_future_field": 1}, "some_future_field", "unknown field"),
        ({"use_beam_search": True}, "use_beam_search", "unknown field"),
        ({"messages": [{"role": "user", "content": "hi", "reasoning": "x"}]}, "messages.0.reasoning", "unknown field"),
        ({"priority": 3}, "priority", "not supported yet"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "only true"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "set one of"),
        ({"guided_json": {}, "response_format": {"type": "json_object"}}, "response_format", "guided_"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set messages"),
    ],
)
async def test_a_field_not_served_as_written_is_a_400_naming_it(model, mesh, extra, param, says) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
    async with http_gateway(model, mesh) as served:
        with pytest.raises(openai.BadRequestError) as e:
            await served.client().post("/chat/completions", body=body, cast_to=object)

    assert e.value.body["param"] == param
    assert says in e.value.body["message"]
    assert not mesh.prefills


async def test_lenient_fields_ignores_unknown_fields_only(model, mesh) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi", "reasoning": "x"}],
        "some_future_field": {"a": 1},
        "max_tokens": 3,
    }
    async with http_gateway(model, mesh, lenient_fields=True) as served:
        await served.client().post("/chat/completions", body=body, cast_to=object)
        with pytest.raises(openai.BadRequestError) as e:  # a known field's bad value is still a 400
            await served.client().post("/chat/completions", body={**body, "priority": 1}, cast_to=object)

    assert e.value.body["param"] == "priority"
    [(_, prefill)] = mesh.prefills
    assert prefill.sampling.max_tokens == 3


async def test_chat_applies_the_template_to_text_parts(model, mesh) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second " * 10}]},
    ]
    async with http_gateway(model, mesh) as served:
        done = await served.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4)

    expected = model.tokenizer.encode(
        model.tokenizer.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first\n" + "second " * 10}]
        ),
        add_special_tokens=False,
    )
    assert list(mesh.routes[0].tokens.token_ids) == expected
    [choice] = done.choices
    assert choice.message.role == "assistant" and choice.message.content == TEXT and choice.finish_reason == "length"
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")


async def test_a_chat_stream_with_usage(model, mesh) -> None:
    async with http_gateway(model, mesh) as served:
        stream = await served.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi " * 20}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]

    *tokens, last = chunks
    assert [c.choices[0].delta.role for c in tokens] == ["assistant", None, None, None]
    assert "".join(c.choices[0].delta.content for c in tokens) == TEXT
    assert [c.choices[0].finish_reason for c in tokens] == [None, None, None, "length"]
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens == len(mesh.routes[0].tokens.token_ids)


async def test_a_completion_stream_is_sse_ending_in_done(model, mesh) -> None:
    async with http_gateway(model, mesh) as served, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True, "n": 2}
        async with http.post(served.url + "/v1/completions", json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.text()

    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2]) and len(events[:-2]) == 8  # 2 choices x 4 tokens


async def test_the_request_id_header_is_the_meshs_request_id(model, mesh) -> None:
    async with http_gateway(model, mesh) as served, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
        async with http.post(served.url + "/v1/completions", json=body, headers={"x-request-id": "req-7"}) as r:
            assert r.headers["x-request-id"] == "req-7"
            assert (await r.json())["id"] == "cmpl-req-7"

    assert mesh.routes[0].request_id == "req-7"


async def test_models_health_metrics_and_openapi(model, mesh) -> None:
    async with http_gateway(model, mesh) as served, aiohttp.ClientSession() as http:
        models = await served.client().models.list()
        one = await served.client().models.retrieve("tiny")
        with pytest.raises(openai.NotFoundError):
            await served.client().models.retrieve("gpt-9")
        async with http.get(served.url + "/health") as r:
            health = (r.status, await r.json())
        async with http.get(served.url + "/metrics") as r:
            metrics = await r.text()
        async with http.get(served.url + "/openapi.json") as r:
            document = await r.json()

    assert [m.id for m in models.data] == ["tiny"] and one.owned_by == "test-model (RANDOM WEIGHTS)"
    assert one.max_model_len == 256
    assert health == (200, {"status": "ok"})
    assert 'kvmesh_http_requests_total{route="/v1/models",status="200"} 1.0' in metrics
    assert 'kvmesh_http_requests_total{route="/v1/models/{model}",status="404"} 1.0' in metrics
    assert document["openapi"] == "3.1.0" and "/v1/chat/completions" in document["paths"]


async def test_a_draining_gateway_refuses_new_generations(model, mesh) -> None:
    async with http_gateway(model, mesh) as served, aiohttp.ClientSession() as http:
        served.api.draining = True
        async with http.get(served.url + "/health") as r:
            health = (r.status, await r.json())
        with pytest.raises(openai.InternalServerError) as info:
            await served.client().completions.create(model="tiny", prompt=PROMPT)

    assert health == (503, {"status": "draining"})
    assert info.value.status_code == 503 and "shutting down" in info.value.message
    assert mesh.routes == []


def test_sampling_defaults_leave_the_contracts_unset_fields_unset() -> None:
    from services.gateway.openai_requests import CompletionRequest
    from services.gateway.openai_translate import completion_requests

    [req] = completion_requests(CompletionRequest(model="m", prompt="x"), limit=8)

    assert not req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")
    assert not req.sampling.HasField("seed") and req.sampling.max_tokens == 16
    assert req.sampling.repetition_guard == sampling_pb2.RepetitionGuard()


async def _post_json(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_tokenize_of_a_chat_is_the_prompt_the_mesh_ran(model, mesh) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " * 20}]
    kwargs = {"enable_thinking": False}
    async with http_gateway(model, mesh) as served:
        await served.client().chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
        )
        status, tokenized = await _post_json(
            served.url + "/tokenize", {"model": "tiny", "messages": messages, "chat_template_kwargs": kwargs}
        )
        _, prompt = await _post_json(served.url + "/tokenize", {"model": "tiny", "prompt": "x = 1"})
        _, text = await _post_json(served.url + "/detokenize", {"model": "tiny", "tokens": tokenized["tokens"]})
        bad, error = await _post_json(served.url + "/detokenize", {"model": "tiny", "tokens": [10**6]})

    [(_, prefill)] = mesh.prefills
    assert status == 200 and tokenized["tokens"] == list(prefill.token_ids)
    assert tokenized["count"] == len(prefill.token_ids) and tokenized["max_model_len"] == CONTEXT
    assert prompt["tokens"] == model.tokenizer.encode("x = 1", add_special_tokens=True)
    assert text["prompt"] == model.tokenizer.decode(tokenized["tokens"], skip_special_tokens=False)
    assert "<|im_start|>" in text["prompt"]  # special tokens shown, as the prompt holds them
    assert bad == 400 and error["error"]["param"] == "token_ids"


async def test_tokenize_needs_an_api_key_when_keys_are_set(model, mesh) -> None:
    async with http_gateway(model, mesh, keys=ApiKeys.load(listed="sk-1 team")) as served:
        status, _ = await _post_json(served.url + "/tokenize", {"model": "tiny", "prompt": "x"})
    assert status == 401


async def test_vllm_metric_names_count_requests(model, mesh) -> None:
    async with http_gateway(model, mesh, metrics=GatewayMetrics(model_name="tiny")) as served:
        done = await served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=3)

    labels = {"model_name": "tiny"}
    assert sample(served.gateway, "vllm:request_success_total", finished_reason="length", **labels) == 1
    assert sample(served.gateway, "vllm:time_to_first_token_seconds_count", **labels) == 1
    assert sample(served.gateway, "vllm:e2e_request_latency_seconds_count", **labels) == 1
    assert sample(served.gateway, "vllm:request_generation_tokens_sum", **labels) == done.usage.completion_tokens
    assert sample(served.gateway, "vllm:request_prompt_tokens_sum", **labels) == len(PROMPT)
