"""Bad input is refused with a message naming the problem, before any worker is called; tokenize; models."""

from __future__ import annotations

import math

import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.engine.stop_strings import stop_cut
from kvmesh.errors import InvalidArgument, NotFound
from tests.gateway.conftest import CONTEXT, LABEL
from tests.gateway.fakes import FakeMesh
from tests.gateway.helpers import collect, make_gateway, request


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (gateway_pb2.GenerateRequest(), "prompt is empty"),
        (request(""), "prompt is empty"),
        (request([]), "prompt is empty"),
        (request([1, 2, 100_000]), "prompt: token id 100000 is outside the vocabulary"),
        (request(list(range(CONTEXT))), f"prompt has {CONTEXT} tokens; the model's context is {CONTEXT}"),
        (
            request(max_tokens=CONTEXT),
            f"+ sampling.max_tokens ({CONTEXT}) exceeds the model's context of {CONTEXT} tokens",
        ),
        (request(temperature=-0.5), "sampling.temperature must be a finite number in [0, 2], got -0.5"),
        (request(temperature=math.nan), "sampling.temperature must be a finite number in [0, 2], got nan"),
        (request(temperature=-0.0), "sampling.temperature must be a finite number in [0, 2], got -0.0"),
        (request(temperature=math.inf), "sampling.temperature must be a finite number in [0, 2], got inf"),
        (request(top_p=math.nan), "sampling.top_p must be a finite number in (0, 1], got nan"),
        (request(top_p=0.0), "sampling.top_p must be a finite number in (0, 1], got 0.0"),
        (request(top_p=1.5), "sampling.top_p must be a finite number in (0, 1], got 1.5"),
        (request(min_p=1.0), "sampling.min_p must be a finite number in [0, 1), got 1.0"),
        (request(logprobs=True, top_logprobs=21), "sampling.top_logprobs must be in [0, 20], got 21"),
        (request(top_logprobs=2), "sampling.top_logprobs needs sampling.logprobs"),
        (request(stop=["ok", ""]), "sampling.stop: stop strings must be non-empty"),
        (request(stop_token_ids=[5, 999_999]), "sampling.stop_token_ids: token id 999999 is outside the vocabulary"),
        (
            request(repetition_guard=sampling_pb2.RepetitionGuard(max_repeats=3, allowed_token_ids=[999_999])),
            "sampling.repetition_guard.allowed_token_ids: token id 999999",
        ),
    ],
)
async def test_bad_requests_are_refused_before_routing(model, req, message) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)

    with pytest.raises(InvalidArgument) as info:
        await collect(gateway, req)

    assert message in info.value.message
    assert mesh.routes == [] and gateway.inflight == 0


async def test_an_unknown_model_is_not_found(model) -> None:
    gateway = make_gateway(model, FakeMesh())
    req = request()
    req.model = "gpt-9"

    with pytest.raises(NotFound, match="model 'gpt-9' is not served here; this gateway serves 'tiny'"):
        await collect(gateway, req)


async def test_chat_renders_the_template_without_adding_special_tokens(model) -> None:
    mesh = FakeMesh()
    gateway = make_gateway(model, mesh)
    chat = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])

    chunks = [c async for c in gateway.chat(chat, "rid")]

    expected = model.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert list(mesh.routes[0].tokens.token_ids) == expected
    assert chunks[-1].HasField("final")


@pytest.mark.parametrize(
    ("messages", "message"),
    [([], "messages is empty"), ([gateway_pb2.ChatMessage(content="hi")], "messages[0].role is empty")],
)
async def test_bad_chats_are_refused(model, messages, message) -> None:
    gateway = make_gateway(model, FakeMesh())

    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        [c async for c in gateway.chat(gateway_pb2.ChatRequest(messages=messages), "rid")]


async def test_tokenize_text_and_chat(model) -> None:
    gateway = make_gateway(model, FakeMesh())
    text = "print('hello')"

    plain = await gateway.tokenize(gateway_pb2.TokenizeRequest(text=text))
    chat = await gateway.tokenize(
        gateway_pb2.TokenizeRequest(
            chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=text)])
        )
    )

    assert plain == model.tokenizer.encode(text, add_special_tokens=False)
    assert model.tokenizer.decode(chat, skip_special_tokens=False).startswith("<|im_start|>user\nprint('hello')")
    with pytest.raises(InvalidArgument, match="nothing to tokenize"):
        await gateway.tokenize(gateway_pb2.TokenizeRequest())


async def test_list_models_reports_the_label_of_a_kvmesh_made_model(model) -> None:
    [info] = await make_gateway(model, FakeMesh()).list_models()

    assert (info.id, info.max_model_len, info.owned_by) == ("tiny", CONTEXT, LABEL)
    assert info.created > 0


def test_stop_strings_cut_at_the_earliest() -> None:
    assert stop_cut("abc</s>def", ["def", "</s>"]) == 3
    assert stop_cut("abc", ["x"]) is None
    # Included: the text ends after the stop; of two stops beginning at one place, the longer.
    assert stop_cut("abc</s>def", ["def", "</s>"], include=True) == 7
    assert stop_cut("ab##c", ["#", "##"], include=True) == 4
    # Only stops that begin at or after start count.
    assert stop_cut("x.y.", ["."], start=2) == 3
