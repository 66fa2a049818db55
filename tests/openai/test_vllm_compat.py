"""What a client written for vLLM sends and reads, through the real mesh: vLLM's request fields change
the output as vLLM's do, /tokenize is the prompt the engine ran, and vLLM's metric names count the load."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.tokenizer import Tokenizer
from tests.e2e.mesh_helpers import metrics, poll
from tests.openai.conftest import MODEL

pytestmark = pytest.mark.timeout(300)

HELLO = [{"role": "user", "content": "Say something."}]
STREAMS = 16


@pytest.fixture(scope="module")
def tokenizer(openai_model) -> Tokenizer:
    return Tokenizer(openai_model)


def _chat(client, **fields):
    vllm = {k: fields.pop(k) for k in list(fields) if k not in ("max_tokens", "logit_bias", "stop")}
    return client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, extra_body=vllm or None, **fields
    ).choices[0]


def test_min_tokens_holds_back_eos_at_prefill_and_decode(client, tokenizer) -> None:
    eos = {str(tokenizer.eos_token_id): 100}  # EOS would win every step
    assert (
        client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=10, logit_bias=eos
        ).usage.completion_tokens
        == 1
    )
    held = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=10, logit_bias=eos, extra_body={"min_tokens": 5}
    )
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_output(client, tokenizer) -> None:
    token = tokenizer.encode("x", add_special_tokens=False)[0]
    forced = {str(token): 100}
    free = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, logit_bias=forced, extra_body={"ignore_eos": True}
    )
    assert free.usage.completion_tokens == 5
    stopped = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, logit_bias=forced, extra_body={"stop_token_ids": [token]}
    )
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_and_skip_special_tokens(client, tokenizer) -> None:
    free = _chat(client, max_tokens=16, ignore_eos=True).message.content
    stop = free[3:6]
    kept = _chat(client, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.message.content == free[: free.index(stop) + len(stop)]

    eos_text = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)
    eos = {str(tokenizer.eos_token_id): 100}
    hidden = _chat(client, max_tokens=3, ignore_eos=True, logit_bias=eos)
    shown = _chat(client, max_tokens=3, ignore_eos=True, logit_bias=eos, skip_special_tokens=False)
    assert hidden.message.content == "" and shown.message.content == eos_text * 3


def test_guided_choice_and_json(client) -> None:
    choice = _chat(client, max_tokens=8, guided_choice=["yes", "no", "maybe so"])
    assert choice.message.content in ("yes", "no", "maybe so")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = _chat(client, max_tokens=24, guided_json=schema)
    assert isinstance(__import__("json").loads(reply.message.content)["n"], int)


def test_tokenize_is_the_prompt_the_engine_ran(client, base_url) -> None:
    done = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    tokenized = client.post("/../tokenize", body={"model": MODEL, "messages": HELLO}, cast_to=object)
    assert tokenized["count"] == done.usage.prompt_tokens == len(tokenized["tokens"])
    text = client.post("/../detokenize", body={"model": MODEL, "tokens": tokenized["tokens"]}, cast_to=object)
    assert "Say something." in text["prompt"]


def _vllm_sum(mesh, name: str) -> float:
    """What a dashboard's sum(name) over every scraped process reads."""
    return sum(
        value
        for process in ("gateway", "prefill-0", "decode-0")
        for sample, value in metrics(mesh, process).items()
        if sample.split("{")[0] == name
    )


async def test_vllm_metric_names_count_running_requests(mesh, aclient) -> None:
    streams = [
        await aclient.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(STREAMS)
    ]
    try:
        await asyncio.gather(*(anext(aiter(s)) for s in streams))  # every request has its first token
        busy = await asyncio.to_thread(
            poll,
            lambda: _vllm_sum(mesh, "vllm:num_requests_running") + _vllm_sum(mesh, "vllm:num_requests_waiting"),
            lambda n: n == STREAMS,
        )
        assert busy == STREAMS
        assert 0 < _vllm_sum(mesh, "vllm:kv_cache_usage_perc") <= 2  # two workers' fractions
    finally:
        for s in streams:
            await s.close()
    idle = await asyncio.to_thread(poll, lambda: _vllm_sum(mesh, "vllm:num_requests_running"), lambda n: n == 0)
    assert idle == 0
    assert _vllm_sum(mesh, "vllm:time_to_first_token_seconds_count") >= STREAMS
    assert _vllm_sum(mesh, "vllm:generation_tokens_total") > 0
